"""The prompt both sides of an episode build: the first prompt's instructions, the search tool's schema, the exact
token wrappers of a tool turn, and the note that one turn is left.

Why here, in the environment layer (`dspo.env`): two layers render this prompt, and it must be the same tokens in
both. The agent loop builds its context from it (`dspo.agent.tool_calling`, the endpoint's formats, self-play), and an
environment rebuilds that context (`dspo.env.answerer`: the planner's answerer reads the planner's episode token for
token as the planner's context held it). Folders import only downward (tests/test_layers.py: engines <- environment
<- agent <- rollout orchestration), so an environment may import no agent module, not even lazily inside a function;
the agent may import the environment. The one rendering therefore sits in the lower of the two layers, beside the
search tool whose schema it renders (`dspo.env.search_tool`), and imports nothing else of dspo. `dspo.agent.prompts`
re-exports its names for plug-ins that import them from there.

The prompt is the tokenizer's own chat template (`apply_chat_template(..., tools=[SEARCH_TOOL_SCHEMA])`), so a Qwen2.5
model sees the function-calling prompt it was post-trained on. A tool turn is inserted as the *template* renders it:
`ToolTurnTemplate.from_tokenizer` renders a conversation that ends with an assistant message and a tool message,
both holding sentinel strings, and takes the text between the sentinels (the wrapper before the tool content: end of
the assistant turn, start of the tool turn) and after the tool sentinel (end of the tool turn + next assistant header).
For Qwen2.5 that is `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n` and
`\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`. The wrappers are tokenized once; an observation is
tokenized alone and spliced between them, so model-generated ids are never re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspo.env.search_tool import SEARCH_TOOL_SCHEMA  # the default tool's schema, defined with the tool

QWEN_INSTRUCTION = (
    "Answer the question below. Think step by step inside <think> </think>. Whenever you are missing a fact, call the "
    "search tool; you may search several times. When you know the answer, give only the answer, as a short phrase, "
    "inside <answer> </answer>, for example <answer> Paris </answer>.\n\nQuestion: {question}"
)

SEARCHR1_INSTRUCTION = (
    "Answer the given question. Reason inside <think> and </think> first every time you get new information. If you "
    "lack some knowledge, search by writing <search> query </search>; the top results come back between "
    "<information> and </information>. You may search as many times as you want. When you need no further "
    "knowledge, give the answer inside <answer> and </answer>, without explanation, for example "
    "<answer> Beijing </answer>. Question: {question}\n"
)

# appended to the tool's text of the turn before the last allowed one (`rollout.agent.max_turns`): budgets are the
# environment's to tell, and the answerer (`dspo.env.answerer`) shows it where the planner saw it
LAST_TURN_NOTE = "\n(You have one turn left: give your final answer now.)"

_ASSISTANT_SENTINEL = "\u2983DSPO-ASSISTANT\u2984"
_TOOL_SENTINEL = "\u2983DSPO-TOOL\u2984"


def build_messages(
    question: str, tag_format: str, system_prompt: str | None = None, instruction: str | None = None
) -> list[dict]:
    """Chat messages of the first turn: optional system prompt, then the instruction with the question (`instruction`
    overrides dspo's default for the tag format, which is written for one `search` tool)."""
    if tag_format not in ("qwen", "searchr1"):
        raise ValueError(f"AgentConfig.tag_format={tag_format!r}: expected 'qwen' or 'searchr1'")
    template = instruction or (QWEN_INSTRUCTION if tag_format == "qwen" else SEARCHR1_INSTRUCTION)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": template.format(question=question.strip())})
    return messages


def render_prompt(tokenizer, messages: list[dict], tag_format: str, tools: list[dict] | None = None) -> str:
    """The chat-template text of the first prompt, ending with the assistant header. In `qwen` format the template
    renders the tools' schemas (default: the search tool's); Search-R1's prompt describes its tags in words."""
    schemas = (tools if tools is not None else [SEARCH_TOOL_SCHEMA]) if tag_format == "qwen" else None
    return tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=False)


@dataclass
class ToolTurnTemplate:
    """Token ids the environment inserts around an observation: `prefix + observation + suffix`."""

    prefix_text: str
    suffix_text: str
    prefix_ids: list[int]
    suffix_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer, tag_format: str) -> ToolTurnTemplate:
        if tag_format == "searchr1":
            # Search-R1 keeps the whole episode in one assistant turn; results are plain text between tags.
            prefix, suffix = "\n\n<information>", "</information>\n\n"
        else:
            prefix, suffix = _diff_tool_turn(tokenizer)
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
        suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
        return cls(prefix, suffix, prefix_ids, suffix_ids)


def _diff_tool_turn(tokenizer) -> tuple[str, str]:
    """Render [user, assistant(sentinel), tool(sentinel)] + generation prompt and cut the wrappers out of it."""
    base = [{"role": "user", "content": "question"}]
    head = tokenizer.apply_chat_template(base, tools=[SEARCH_TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)
    full_messages = base + [
        {"role": "assistant", "content": _ASSISTANT_SENTINEL},
        {"role": "tool", "content": _TOOL_SENTINEL},
    ]
    full = tokenizer.apply_chat_template(
        full_messages, tools=[SEARCH_TOOL_SCHEMA], add_generation_prompt=True, tokenize=False
    )
    if not full.startswith(head + _ASSISTANT_SENTINEL) or full.count(_TOOL_SENTINEL) != 1:
        raise ValueError(
            "the tokenizer's chat template does not render an assistant message verbatim after the generation "
            "prompt, followed by one tool message; multi-turn rollouts need such a template (Qwen2.5-style). "
            f"Rendered: {full!r}"
        )
    rest = full[len(head) + len(_ASSISTANT_SENTINEL) :]
    prefix, suffix = rest.split(_TOOL_SENTINEL)
    return prefix, suffix
