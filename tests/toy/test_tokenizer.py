"""Local tokenizer: vocab size, single-id special/tag tokens, Qwen2.5-shaped chat template, save/load."""

from __future__ import annotations

import json

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer

from dspo.process.resources import data_dir
from dspo.toy import tokenizer as tk
from dspo.toy.world import ToyWorldConfig, generate_world

QWEN = data_dir() / "tokenizers" / "qwen2.5" / "tokenizer_config.json"
SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus.",
        "parameters": {"type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}}}},
    },
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    _, corpus, qa, words, _ = generate_world(ToyWorldConfig(num_train=300, num_val=50, num_test=50, num_demo=300))
    texts = [c["contents"] for c in corpus] + [q["question"] for q in qa["train"]]
    out = tmp_path_factory.mktemp("tok")
    tk.train_tokenizer(texts, str(out), vocab_size=1024, words=words + ["Zorblax", "Kofa"])
    return str(out)


def _qwen_render(messages: list[dict], **kwargs) -> str:
    template = json.loads(QWEN.read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # what transformers installs
    return env.from_string(template).render(messages=messages, **kwargs)


CONVERSATIONS = [
    [{"role": "user", "content": "Where was Kofa Brel born?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Q?"}],
    [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "Who founded Zorblax Corp?"},
        {"role": "assistant", "content": '<think>x</think>\n<tool_call>\n{"name": "search"}\n</tool_call>'},
        {"role": "tool", "content": "Doc 1 (Title: Zorblax Corp) text"},
        {"role": "tool", "content": "Doc 2"},
        {"role": "assistant", "content": "<answer>Kofa Brel</answer>"},
        {"role": "user", "content": "Thanks"},
    ],
    [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {"q": 1}}}]},
        {"role": "tool", "content": "obs"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, [SCHEMA]])
def test_template_matches_qwen_modulo_system_text(tok_dir, messages, tools) -> None:
    ours = AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    theirs = _qwen_render(messages, tools=tools, add_generation_prompt=True)
    theirs = theirs.replace(tk.QWEN_DEFAULT_SYSTEM, tk.DEFAULT_SYSTEM)
    theirs = theirs.replace(tk.QWEN_TOOLS_PREFIX, tk.TOOLS_PREFIX).replace(tk.QWEN_TOOLS_SUFFIX, tk.TOOLS_SUFFIX)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_vocab_and_special_ids(tok_dir) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 1024
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for token in tk.SPECIAL_TOKENS + tk.TAG_TOKENS:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == token
    text = '<think>a</think>\n<tool_call>\n{"name": "search"}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")  # tags survive


def test_round_trips_world_text(tok_dir) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    text = '"Zorblax Corp"\nZorblax Corp was founded by Kofa Brel in 1901. It has 12,000 inhabitants.'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_words_are_one_id_in_every_context(tok_dir) -> None:
    """A name word keeps its single id after a space, a quote, a tag, and at the start of a longer word, so copying
    a name from a passage into a query or an answer is copying ids."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    word_id = tok.convert_tokens_to_ids("Zorblax")
    assert word_id != tok.unk_token_id
    for text in [" Zorblax Corp", '"Zorblax"', "<answer>Zorblax</answer>", "Zorblaxburg", "<search> Zorblax"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids.count(word_id) == 1, (text, tok.convert_ids_to_tokens(ids))
        assert tok.decode(ids) == text


def test_rejects_words_with_spaces(tmp_path) -> None:
    with pytest.raises(ValueError, match="white space"):
        tk.train_tokenizer(["abc def"] * 50, str(tmp_path), vocab_size=300, words=["two words"])


def test_rejects_tiny_vocab(tmp_path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_tokenizer(["abc"], str(tmp_path), vocab_size=100)
