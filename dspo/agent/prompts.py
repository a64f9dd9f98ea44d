"""The first prompt, the search tool's schema and a tool turn's token wrappers: moved to `dspo.env.prompting`, the
layer below the agent, because an environment renders them too (`dspo.env.answerer`) and may not import the agent.
Re-exported here for plug-ins that import them from `dspo.agent.prompts`."""

from dspo.env.prompting import (  # noqa: F401  _diff_tool_turn: re-exported with the rest (old import path)
    LAST_TURN_NOTE,
    QWEN_INSTRUCTION,
    SEARCH_TOOL_SCHEMA,
    SEARCHR1_INSTRUCTION,
    ToolTurnTemplate,
    _diff_tool_turn,
    build_messages,
    render_prompt,
)

__all__ = [
    "LAST_TURN_NOTE",
    "QWEN_INSTRUCTION",
    "SEARCHR1_INSTRUCTION",
    "SEARCH_TOOL_SCHEMA",
    "ToolTurnTemplate",
    "build_messages",
    "render_prompt",
]
