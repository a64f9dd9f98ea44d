"""A small byte-level BPE tokenizer trained locally, with Qwen2.5's special tokens and chat template structure.

Why not Qwen2.5's own tokenizer: its 151k-entry vocabulary would make the tiny model's embedding and LM head (and so
every CPU step) dominated by the vocabulary. A ~2k vocabulary trained on the toy world keeps the model small while the
token *format* stays the one a real run sees.

Token choices (documented in docs/toyworld.md):
- special tokens (skipped by `decode(skip_special_tokens=True)`): `<|endoftext|>` (pad), `<|im_start|>`,
  `<|im_end|>` (eos) — as in Qwen2.5.
- added, non-special tokens (always one id, kept when decoding, so stop strings and parsers see them):
  `<tool_call>`, `</tool_call>` (added tokens in Qwen2.5 too), and `<tool_response>`, `</tool_response>`, `<think>`,
  `</think>`, `<answer>`, `</answer>` and Search-R1's `<search>`, `</search>`, `<information>`, `</information>`
  (plain text in Qwen2.5; single ids here to keep the tiny model's sequences short).
- `words` (the toy world's invented name words) are added tokens too: one id each, whatever character precedes them,
  so copying a name from a passage into a query or an answer is a pure copy of ids (see `train_tokenizer`).
- pre-tokenization: Qwen2's byte-level regex (" which" is one piece, as in GPT-2/Qwen).
- chat template: Qwen2.5's template with the same structure (system + `# Tools` block with one JSON schema per line,
  assistant tool calls, tool messages grouped as `<tool_response>` blocks in a user turn, `<|im_start|>assistant\\n`
  generation prompt); only the default system text and the prose around `<tools>` are shorter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
]

# The three strings where this template's text departs from Qwen2.5's (tests map one onto the other).
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREFIX = "\n\n# Tools\n\nFunction signatures are within <tools></tools>:\n<tools>"
TOOLS_SUFFIX = (
    '\n</tools>\n\nCall a function as:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS_PREFIX = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_SUFFIX = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


def _jinja_str(text: str) -> str:
    """A Jinja string literal for `text` (JSON escaping is valid Jinja/Python string syntax)."""
    import json

    return json.dumps(text)


CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    f"        {{{{- {_jinja_str(DEFAULT_SYSTEM)} }}}}\n"
    "    {%- endif %}\n"
    f"    {{{{- {_jinja_str(TOOLS_PREFIX)} }}}}\n"
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    f"    {{{{- {_jinja_str(TOOLS_SUFFIX)} }}}}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    f"        {{{{- '<|im_start|>system\\n' + {_jinja_str(DEFAULT_SYSTEM)} + '<|im_end|>\\n' }}}}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _template_texts() -> list[str]:
    """Text the chat template itself emits, so its pieces get compact tokens."""
    return [DEFAULT_SYSTEM, TOOLS_PREFIX, TOOLS_SUFFIX, "<|im_start|>user\n", "<|im_start|>assistant\n"] * 20


def train_tokenizer(
    texts: Iterable[str], output_dir: str, vocab_size: int = 2048, words: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`, attach the chat template, save it to `output_dir`, return it.

    `words` become added (non-special) tokens: one id each wherever they occur, even inside a longer word
    ("Proupre" in "Proupredale" -> `Proupre` + `dale`). Give words that are not substrings of ordinary text.
    `vocab_size` counts every id (256 byte symbols, merges, special, tag and word tokens). The saved directory loads
    with `AutoTokenizer.from_pretrained(output_dir)` (and so with vLLM).
    """
    words = sorted(set(words))
    bad = [w for w in words if not w or any(c.isspace() for c in w)]
    if bad:
        raise ValueError(f"train_tokenizer: words must be non-empty and without white space, got {bad[:5]}")
    reserved = len(SPECIAL_TOKENS) + len(TAG_TOKENS) + len(words)
    if vocab_size < 256 + reserved + 1:
        raise ValueError(
            f"train_tokenizer: vocab_size={vocab_size} is too small; byte-level BPE needs > {256 + reserved}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # the trainer counts special tokens; tags and words are added afterwards
        vocab_size=vocab_size - len(TAG_TOKENS) - len(words),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_with_template_texts(texts, words), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.add_tokens(TAG_TOKENS, special_tokens=False)
    tokenizer.add_tokens([AddedToken(w, normalized=False, special=False) for w in words])
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise RuntimeError(
            f"train_tokenizer: got {len(tokenizer)} ids, asked for {vocab_size}; the training texts are too small to "
            "learn that many merges — pass more text or a smaller vocab_size"
        )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return tokenizer


def _with_template_texts(texts: Iterable[str], words: Sequence[str]) -> Iterable[str]:
    """Template texts, then `texts` with the added words cut out (their ids are fixed; merges go to the rest)."""
    yield from _template_texts()
    if not words:
        yield from texts
        return
    pattern = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    for text in texts:
        yield pattern.sub("\n", text)  # a line break: the rest of a word ("dale" of "Proupredale") stays a piece


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `train_tokenizer` (local files only, no remote code)."""
    if not Path(path, "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}; train one with dspo.toy.tokenizer.train_tokenizer")
    return AutoTokenizer.from_pretrained(path)
