"""What every agent's rollout shares: running one tool's batch of calls (failures become per-call tool errors, a slow
batch a timeout), failing a round whose tool fails too often, and the rollout statistics (`rollout/<key>`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from dspo.agent.stats import Kind
from dspo.env.tools import CallContext, ToolResult, ToolUnavailableError
from dspo.types import QAItem, RolloutGroup, Trajectory

# the kinds of `rollout_stats`' keys (dspo.agent.stats): the round adds the counts, weights the means by trajectories
# and recomputes the call-only figures from its groups
CALL_STAT_KINDS: dict[str, Kind] = {
    **dict.fromkeys(("generation_s", "tool_s", "other_s", "generated_tokens", "tokens_per_s"), Kind.CALL),
    **dict.fromkeys(("tool_calls_mean", "invalid_calls", "turns_mean", "response_len_mean"), Kind.CALL),
    **dict.fromkeys(("truncated_share", "reward_mean"), Kind.CALL),
    "invalid/": Kind.SUM,  # invalid/<tool>/<kind>
    "tool_errors/": Kind.SUM,  # tool_errors/<tool>
    "calls/": Kind.MEAN,  # calls/<tool>: per trajectory
    "tool/": Kind.MEAN,  # tool/<tool>/<metric>: ToolResult.metrics
    "reward/": Kind.MEAN,  # reward/<component>: logged without the rollout/ prefix
}


class ToolFailureError(RuntimeError):
    """A tool failed on more than `env.max_tool_error_share` of a batch's calls: the round is not trained on them."""


def grouped(items: Sequence[QAItem], trajectories: list[Trajectory], group_size: int) -> list[RolloutGroup]:
    """The `group_size` consecutive trajectories of each item as its group, in `items` order (`prompt_index` = the
    item's position)."""
    return [
        RolloutGroup(item=item, trajectories=trajectories[i * group_size : (i + 1) * group_size], prompt_index=i)
        for i, item in enumerate(items)
    ]


def run_tool_batch(tool: Any, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
    """`tool.run` with its failures turned into per-call tool errors (a backend that is down fails the round)."""
    try:
        results = run_with_timeout(tool, calls, contexts)
        if len(results) != len(calls):
            raise RuntimeError(f"{type(tool).__name__}.run returned {len(results)} results for {len(calls)} calls")
    except ToolUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside a tool is a tool error, counted and bounded
        reason = f"{type(exc).__name__}: {exc}"
        message = f"Error: the {tool.name} tool failed on this call ({reason[:300]}). Try again or answer."
        return [ToolResult(text=message, error=reason) for _ in calls]
    return results


def check_tool_errors(env: Any, episodes: Sequence[Any]) -> None:
    """Fail the batch when a tool failed on more than `env.max_tool_error_share` of its calls (episodes: with
    `tool_calls`, `tool_errors` counters and `turns`)."""
    calls = sum((ep.tool_calls for ep in episodes), Counter())
    errors = sum((ep.tool_errors for ep in episodes), Counter())
    for name, failed in errors.items():
        share = failed / max(calls[name], 1)
        if share > env.max_tool_error_share:
            first = next((t.result.error for ep in episodes for t in ep.turns if t.result and t.result.error), "?")
            raise ToolFailureError(
                f"tool {name!r} failed on {failed} of {calls[name]} calls in this batch (share {share:.2f} > "
                f"env.max_tool_error_share={env.max_tool_error_share}); first failure: {first}. Check the "
                "tool's backend (index, service, model): the round is aborted rather than trained on error messages"
            )


def rollout_stats(
    tools: Mapping[str, Any], trajectories: list[Trajectory], episodes: Sequence[Any], timers: dict, total: float
) -> dict:
    """The statistics of one rollout call, logged as `rollout/<key>` by their kinds (`CALL_STAT_KINDS`) (episodes:
    with `invalid`, `tool_errors` counters and `turns`; timers: generation_s, tool_s, generated_tokens)."""
    n = max(len(trajectories), 1)
    invalid = sum((ep.invalid for ep in episodes), Counter())
    stats = {
        "generation_s": timers["generation_s"],
        "tool_s": timers["tool_s"],  # time inside tools (the search tool's retriever, by default)
        "other_s": max(total - timers["generation_s"] - timers["tool_s"], 0.0),
        "generated_tokens": float(timers["generated_tokens"]),
        "tokens_per_s": timers["generated_tokens"] / max(timers["generation_s"], 1e-9),
        "tool_calls_mean": sum(t.num_tool_calls for t in trajectories) / n,
        "invalid_calls": float(sum(invalid.values())),
        "turns_mean": sum(t.num_turns for t in trajectories) / n,
        "response_len_mean": sum(len(t.response_ids) for t in trajectories) / n,
        "truncated_share": sum(t.truncated for t in trajectories) / n,
        "reward_mean": sum(t.reward for t in trajectories) / n,
    }
    stats.update({f"invalid/{tool}/{kind}": float(count) for (tool, kind), count in invalid.items()})
    stats.update({f"calls/{name}": sum(t.tool_calls.get(name, 0) for t in trajectories) / n for name in tools})
    errors = sum((ep.tool_errors for ep in episodes), Counter())
    stats.update({f"tool_errors/{name}": float(count) for name, count in errors.items()})
    for tool in tools:  # tool metrics (ToolResult.metrics): means over the batch's calls of each tool
        measured = [t.result.metrics for ep in episodes for t in ep.turns if t.call and t.call[0] == tool and t.result]
        for key in sorted({k for m in measured for k in m}):
            values = [m[key] for m in measured if key in m]
            stats[f"tool/{tool}/{key}"] = sum(values) / len(values)
    for key in sorted({key for t in trajectories for key in t.reward_components}):
        # over the trajectories that report it (every one, for the shipped rewards but two sources' right_tool)
        values = [t.reward_components[key] for t in trajectories if key in t.reward_components]
        stats[f"reward/{key}"] = sum(values) / len(values)
    return stats


def run_with_timeout(tool, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
    """`tool.run(calls, contexts)`, bounded by `tool.timeout_s` when set (the late batch keeps running in its thread,
    which cannot be stopped from outside; its results are dropped)."""
    timeout = getattr(tool, "timeout_s", None)
    if timeout is None:
        return tool.run(calls, contexts)
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dspo-tool-{tool.name}")
    try:
        return pool.submit(tool.run, calls, contexts).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"the {tool.name} tool took longer than its timeout_s={timeout}") from None
    finally:
        pool.shutdown(wait=False)
