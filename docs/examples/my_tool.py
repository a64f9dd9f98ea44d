"""A new tool: ReSeek's JUDGE action. The agent says whether the evidence it has is enough to answer; the tool only
acknowledges (what a judgment is worth is the reward's business: my_reward.py). docs/extending.md, section 6."""

from dspo.env import Tool, ToolResult


class JudgeTool(Tool):
    name = "judge"
    description = "Judge whether the documents retrieved so far are enough to answer the question."
    parameters = {
        "type": "object",
        "properties": {"verdict": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["verdict"],
    }
    tag_argument = "verdict"  # Search-R1 format: <judge> yes </judge>

    def run(self, calls, contexts):
        # one call per episode that judged in this turn, already checked against `parameters`
        notes = {"yes": "Noted: answer now.", "no": "Noted: search for what is missing."}
        return [ToolResult(notes[call["verdict"]]) for call in calls]
