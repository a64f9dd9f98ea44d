"""Issue 39 (4): `env.instruction` is a template with one placeholder, checked when the environment is built."""

from __future__ import annotations

import pytest

from dspo.agent.prompts import build_messages
from dspo.env import Environment, SubEMReward

JSON_EXAMPLE = 'Call the tool as {"name": "search", "arguments": {"query_list": ["q"]}}. Question: {question}'


@pytest.mark.parametrize(
    ("instruction", "named"),
    [
        (JSON_EXAMPLE, '{"name"} is not a placeholder'),
        ("Question: {question} (answer {0})", "{0} is not a placeholder"),
        ("Question: {question", "expected '}' before end of string"),
    ],
)
def test_an_instruction_the_template_cannot_take_fails_when_the_environment_is_built(instruction, named) -> None:
    with pytest.raises(ValueError) as error:
        Environment({}, SubEMReward(), instruction=instruction)
    message = str(error.value)
    assert message.startswith("env.instruction: ") and named in message
    assert "write a literal brace as {{ and }}" in message


def test_doubled_braces_reach_the_prompt_as_literal_braces() -> None:
    escaped = JSON_EXAMPLE.replace("{", "{{").replace("}", "}}").replace("{{question}}", "{question}")
    env = Environment({}, SubEMReward(), instruction=escaped)
    (message,) = build_messages("Who?", "qwen", instruction=env.instruction)
    assert message["content"] == JSON_EXAMPLE.replace("{question}", "Who?")


def test_an_instruction_without_the_question_is_refused() -> None:
    with pytest.raises(ValueError, match="env.instruction must contain {question}"):
        Environment({}, SubEMReward(), instruction="Answer. {{question}}")  # a literal, not the placeholder
