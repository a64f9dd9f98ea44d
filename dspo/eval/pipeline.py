"""Greedy evaluation shared by `dspo-eval` and validation during training: predict → score → write.

No Lightning here: the training module calls `predict` + `update_metrics` (or `score`) from its validation hooks,
`dspo.eval.cli` calls them from the command line, so both report identical numbers.

Scores are the paper's subEM (Eq. 4) plus EM and token F1, all with FlashRAG / Search-R1 answer normalization,
computed by the torchmetrics classes of `dspo.metrics` (exact sums and counts, safe to reduce across processes).
A trajectory that never produced `<answer>` scores 0 on all three (its answer is recorded as the empty string, and
scored as missing: `dspo.metrics` explains the rule for blank answers and golds, the same as the training reward's).

When the environment's reward is judged (`env/reward=judge`, `dspo.env.judge`), each trajectory carries the reward
components `judge` (the verdict), `judge_agrees` (verdict == subEM) and `judge_error` (1.0: the verdict failed); the
report then puts the judge's score beside subEM / EM / F1 (`JUDGE_KEYS`). Episodes whose verdict failed count in
`judge_errors` only, never as a 0 or as a copied subEM in `judge`: a judge that is down must not look like a strict one.

results.json also holds `pinned` (`dspo.eval.pinned`): every setting that decides the scores; `read_results` splits it
from the benchmark rows, which stay at the top level where older readers find them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchmetrics import MetricCollection

from dspo.agent.protocol import Agent, answering
from dspo.eval.answer_metrics import benchmark_metrics
from dspo.metrics import exact_match, sub_exact_match, token_f1
from dspo.types import QAItem, RolloutGroup

RESULT_KEYS = ("subem", "em", "f1", "n", "mean_tool_calls", "mean_turns")
JUDGE_KEYS = ("judge", "judge_agreement", "judge_errors")  # per benchmark, when trajectories carry a judge's verdict
AVERAGE = "average"  # the row of results.json / results.md holding the macro average over benchmarks (paper's Avg.)
PINNED = "pinned"  # the key of results.json holding what decides the scores (dspo.eval.pinned); no benchmark's name


@dataclass
class Prediction:
    """One greedy answer to one question, with its scores and the agent's effort."""

    id: str
    benchmark: str
    question: str
    golden_answers: list[str]
    answer: str  # "" when the episode ended without an <answer>
    correct: float  # subEM (the paper's metric and reward)
    em: float
    f1: float
    num_turns: int
    num_tool_calls: int
    truncated: bool = False
    response: str = field(default="", repr=False)  # full response text (model and tool turns), for error analysis
    judge: float | None = None  # the judge's verdict (reward component `judge`); None: no judge, or it failed
    judge_agrees: float | None = None  # 1.0 when the verdict equals subEM (reward component `judge_agrees`)
    judge_error: float | None = None  # 1.0 when the judge failed on this episode (reward component `judge_error`)

    @classmethod
    def from_group(cls, group: RolloutGroup) -> Prediction:
        if len(group.trajectories) != 1:
            raise ValueError(f"greedy evaluation expects 1 trajectory per group, got {len(group.trajectories)}")
        trajectory, item = group.trajectories[0], group.item
        answer = trajectory.answer  # None when the episode ended without an <answer>: wrong, whatever the golds
        components = trajectory.reward_components
        failed = components.get("judge_error")
        judged = "judge" in components and not failed
        return cls(
            id=item.id,
            benchmark=item.benchmark,
            question=item.question,
            golden_answers=list(item.golden_answers),
            answer=answer or "",
            correct=sub_exact_match(answer, item.golden_answers),
            em=exact_match(answer, item.golden_answers),
            f1=token_f1(answer, item.golden_answers),
            num_turns=trajectory.num_turns,
            num_tool_calls=trajectory.num_tool_calls,
            truncated=trajectory.truncated,
            response=trajectory.response_text,
            judge=float(components["judge"]) if judged else None,
            judge_agrees=float(components["judge_agrees"]) if judged and "judge_agrees" in components else None,
            judge_error=None if failed is None else float(failed),
        )


def predict(
    agent: Agent,
    items: Sequence[QAItem],
    batch_size: int,
    policy_version: int = 0,
    progress: bool = True,
    description: str = "eval",
) -> list[Prediction]:
    """Greedy (group_size=1) multi-turn rollouts over `items`, `batch_size` questions per agent call, in input order."""
    if batch_size < 1:
        raise ValueError(f"predict: batch_size must be >= 1, got {batch_size} (config key eval.batch_size)")
    batches = [list(items[start : start + batch_size]) for start in range(0, len(items), batch_size)]
    agent = answering(agent)  # an agent of several roles answers with one of them (dspo.agent.roles)
    predictions: list[Prediction] = []
    bar = _progress(len(items), description) if progress else None
    for batch in batches:
        groups = agent.rollout(batch, group_size=1, policy_version=policy_version, greedy=True).groups
        if [g.item.id for g in groups] != [i.id for i in batch]:
            raise RuntimeError(
                f"predict: agent returned groups for {[g.item.id for g in groups]}, asked for {[i.id for i in batch]}"
            )
        predictions.extend(Prediction.from_group(group) for group in groups)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix(subem=f"{sum(p.correct for p in predictions) / len(predictions):.3f}")
    if bar is not None:
        bar.close()
    return predictions


def _progress(total: int, description: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="q", dynamic_ncols=True)


def update_metrics(metrics: dict[str, MetricCollection], predictions: Iterable[Prediction]) -> None:
    """Feed predictions into per-benchmark collections (`dspo.eval.answer_metrics.benchmark_metrics`'s), one update
    each."""
    by_benchmark: dict[str, list[Prediction]] = {}
    for prediction in predictions:
        by_benchmark.setdefault(prediction.benchmark, []).append(prediction)
    for name, group in by_benchmark.items():
        if name not in metrics:
            raise KeyError(f"update_metrics: no metric collection for benchmark {name!r} (have {sorted(metrics)})")
        metrics[name].update([p.answer for p in group], [p.golden_answers for p in group])


def score(predictions: Sequence[Prediction], stage: str = "test") -> dict[str, dict[str, float]]:
    """{benchmark: {subem, em, f1, n, mean_tool_calls, mean_turns}}, benchmarks in first-seen order."""
    names = list(dict.fromkeys(p.benchmark for p in predictions))
    metrics = benchmark_metrics(names, stage=stage)
    update_metrics(metrics, predictions)
    results: dict[str, dict[str, float]] = {}
    for name in names:
        # The metrics' float64 sum/count states, not `compute()` (which returns float32 for logging), so that
        # results.json holds the exact mean that a recomputation from predictions.jsonl gives.
        exact = {key: float(m.total) / max(int(m.count), 1) for key, m in metrics[name].items(keep_base=True)}
        group = [p for p in predictions if p.benchmark == name]
        results[name] = {
            "subem": exact["subem"],
            "em": exact["em"],
            "f1": exact["f1"],
            "n": len(group),
            "mean_tool_calls": sum(p.num_tool_calls for p in group) / len(group),
            "mean_turns": sum(p.num_turns for p in group) / len(group),
            **judge_scores(group),
        }
    return results


def judge_scores(group: Sequence[Prediction]) -> dict[str, float | int | None]:
    """{judge, judge_agreement, judge_errors} of one benchmark's predictions, {} when none was judged. The means are
    over the episodes with a verdict (None when every verdict failed); `judge_errors` counts the failed ones."""
    if all(p.judge is None and p.judge_error is None for p in group):
        return {}
    verdicts = [p.judge for p in group if p.judge is not None]
    agrees = [p.judge_agrees for p in group if p.judge_agrees is not None]
    return {
        "judge": sum(verdicts) / len(verdicts) if verdicts else None,
        "judge_agreement": sum(agrees) / len(agrees) if agrees else None,
        "judge_errors": sum(bool(p.judge_error) for p in group),
    }


def macro_average(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Unweighted mean over benchmarks (the paper's Avg. column); `n` is the total number of questions."""
    rows = [row for name, row in results.items() if name != AVERAGE]
    if not rows:
        raise ValueError("macro_average: no benchmark results")
    average = {key: sum(row[key] for row in rows) / len(rows) for key in RESULT_KEYS if key != "n"}
    average["n"] = sum(int(row["n"]) for row in rows)
    average = {key: average[key] for key in RESULT_KEYS}
    if all(row.get(key) is not None for row in rows for key in JUDGE_KEYS):  # every benchmark judged
        average["judge"] = sum(row["judge"] for row in rows) / len(rows)
        average["judge_agreement"] = sum(row["judge_agreement"] for row in rows) / len(rows)
        average["judge_errors"] = sum(int(row["judge_errors"]) for row in rows)
    return average


def percent(value: float | None) -> str:
    """A score in percent with one decimal; `-` for none (a judge whose every verdict failed)."""
    return "-" if value is None else f"{100 * value:.1f}"


def markdown_table(results: dict[str, dict[str, float]]) -> str:
    """Results as a Markdown table: scores in percent (one decimal), efforts as means; with the judge's columns when
    some benchmark was judged."""
    judged = any("judge" in row for row in results.values())
    extra = " judge (%) | judge agrees (%) | judge errors |" if judged else ""
    lines = [
        "| benchmark | n | subEM (%) | EM (%) | F1 (%) | search calls | turns |" + extra,
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if judged else ""),
    ]
    for name, row in results.items():
        label = f"**{name}**" if name == AVERAGE else name
        line = (
            f"| {label} | {int(row['n'])} | {100 * row['subem']:.1f} | {100 * row['em']:.1f} | {100 * row['f1']:.1f} "
            f"| {row['mean_tool_calls']:.2f} | {row['mean_turns']:.2f} |"
        )
        if judged:
            errors = row.get("judge_errors")
            line += f" {percent(row.get('judge'))} | {percent(row.get('judge_agreement'))} | "
            line += f"{'-' if errors is None else int(errors)} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_results(
    output_dir: str | Path,
    results: dict[str, dict[str, float]],
    predictions: Sequence[Prediction],
    pinned: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write results.json (per benchmark, plus `average` when there are several, plus `pinned`: what decides the
    scores, `dspo.eval.pinned.collect`), results.md and predictions.jsonl."""
    if PINNED in results:
        raise ValueError(f"a benchmark named {PINNED!r} collides with results.json's pinned settings: rename its file")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = dict(results)
    if len(results) > 1 and AVERAGE not in results:
        table[AVERAGE] = macro_average(results)
    paths = {"results": out / "results.json", "table": out / "results.md", "predictions": out / "predictions.jsonl"}
    document = table if pinned is None else {**table, PINNED: pinned}
    paths["results"].write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    paths["table"].write_text(markdown_table(table), encoding="utf-8")
    with paths["predictions"].open("w", encoding="utf-8") as handle:
        for prediction in predictions:
            handle.write(json.dumps(prediction_row(prediction), ensure_ascii=False) + "\n")
    return paths


def prediction_row(prediction: Prediction) -> dict[str, Any]:
    """One line of predictions.jsonl: the judge's fields only when it judged (files without a judge keep their form)."""
    row = asdict(prediction)
    for key in ("judge", "judge_agrees", "judge_error"):
        if row[key] is None:
            del row[key]
    return row


def read_results(path: str | Path) -> tuple[dict[str, dict[str, float]], dict[str, Any] | None]:
    """(the benchmark rows, the pinned settings or None) of a results.json; files written before `pinned` existed
    hold rows only."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(document, dict):
        raise ValueError(f"{path}: not a dspo results.json (a JSON object of benchmark rows)")
    pinned = document.pop(PINNED, None)
    return document, pinned


def read_predictions(path: str | Path) -> list[Prediction]:
    """Predictions back from a predictions.jsonl written by `write_results`."""
    with Path(path).open(encoding="utf-8") as handle:
        return [Prediction(**json.loads(line)) for line in handle if line.strip()]


def log_tensorboard(log_dir: Path, table: dict[str, dict[str, float]], step: int, stage: str = "test") -> None:
    """`<stage>/<benchmark>/<score>` scalars (the judge's when it judged) and the table as text."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    try:
        for name, row in table.items():
            for key in ("subem", "em", "f1", "mean_tool_calls", "mean_turns", *JUDGE_KEYS):
                if row.get(key) is not None:  # the judge's, when it judged (and some verdict did not fail)
                    writer.add_scalar(f"{stage}/{name}/{key}", row[key], step)
        writer.add_text(f"{stage}/results", markdown_table(table), step)
    finally:
        writer.close()
