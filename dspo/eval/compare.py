"""`dspo-eval --compare A B [--force]`: two reports' tables side by side, refused when a setting that changes the
numbers differs (issue 73, item 4).

    dspo-eval --compare outputs/eval/RUN_A outputs/eval/RUN_B          # folders holding results.json, or the files
    dspo-eval --compare RUN/test/results.json outputs/eval/X/results.json --force

A and B are results.json files, or folders holding one (an eval output folder, a run's `test/`, or the run folder).
Per benchmark it prints n, subEM, EM, F1 (and the judge's score and agreement when both were judged) of A and B and
B - A in points. Which differences of the `pinned` sections (`dspo.eval.pinned`) stop it, per key (`RULES`, first
matching prefix wins; a key no rule names refuses, so a setting added to `pinned` later is safe by default):

- `model.*`: allowed, shown: comparing two models is the point;
- `dspo.*` (version, commit, local changes): a warning: code changes may change numbers, but refusing every comparison
  across commits would refuse every comparison of a run with last week's;
- `sampling.seed`: a warning: evaluation is greedy, the seed picks no token;
- `retriever.url`: a warning: the same index served elsewhere is the same index (its digest is compared);
- `benchmarks.<name>.file_sha256`: a warning: the questions scored are compared by `items_digest`;
- `judge.*`: the judge's columns are left out (the judge decides only them), the other columns are compared;
- anything else (model digest aside: chat template, agent, sampling, engine, retriever, env, normalization, the
  questions scored): refused, exit status 2, each key named with both values.

A benchmark only one report has is listed as such and its row left out, and so is the average then (it averages other
benchmarks). `--force` prints the tables anyway, the refusing differences marked with `!`. A report without `pinned`
(written before dspo pinned its reports) cannot be checked: compared only with `--force`, saying so.
Exit status: 0 compared, 2 refused (or an unreadable report).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspo.eval.pipeline import AVERAGE, read_results

ALLOW, WARN, JUDGE, REFUSE = "allowed", "warning", "judge", "refused"
RULES: tuple[tuple[str, str, str], ...] = (
    ("model", ALLOW, "two models: the comparison's point"),
    ("dspo", WARN, "another dspo version or commit: code changes may change the numbers"),
    ("sampling.seed", WARN, "greedy evaluation: the seed picks no token"),
    ("retriever.url", WARN, "another address; the index is compared by its digest"),
    ("benchmarks.*.file_sha256", WARN, "another file; the questions scored are compared by items_digest"),
    ("judge", JUDGE, "another judge: its columns are left out"),
)
SCORES = (("subem", "subEM"), ("em", "EM"), ("f1", "F1"))
JUDGE_SCORES = (("judge", "judge"), ("judge_agreement", "judge agrees"))
USAGE = "dspo-eval --compare A B [--force]   (A, B: results.json files, or folders holding one)"


@dataclass
class Report:
    path: Path
    rows: dict[str, dict[str, Any]]
    pinned: dict[str, Any] | None


@dataclass
class Difference:
    key: str
    a: Any
    b: Any
    rule: str
    why: str

    def line(self) -> str:
        return f"{self.key}: {_shown(self.a)} (A) vs {_shown(self.b)} (B)"


@dataclass
class Verdict:
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why something cannot be checked, or is left out

    def of(self, rule: str) -> list[Difference]:
        return [d for d in self.differences if d.rule == rule]

    @property
    def refused(self) -> bool:
        return bool(self.of(REFUSE))


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value)


_ABSENT = object()


def results_path(given: str) -> Path:
    """A results.json, or the one in a folder (an eval output folder, a run's `test/`, a run folder)."""
    path = Path(given).expanduser()
    for candidate in (path, path / "results.json", path / "test" / "results.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{given}: no results.json there (give a results.json, or a folder holding one)")


def read_report(given: str) -> Report:
    path = results_path(given)
    rows, pinned = read_results(path)
    return Report(path, rows, pinned)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf} of a nested mapping; lists and empty mappings are leaves."""
    if isinstance(value, Mapping) and value:
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def rule_of(key: str) -> tuple[str, str]:
    """(rule, why) of a pinned key: the first `RULES` prefix it matches (`*` one key part), else refused."""
    parts = key.split(".")
    for prefix, rule, why in RULES:
        wanted = prefix.split(".")
        if len(parts) >= len(wanted) and all(w in ("*", p) for w, p in zip(wanted, parts)):
            return rule, why
    return REFUSE, "changes the numbers"


def compare_pinned(a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """Every differing pinned key with its rule; benchmarks only one side has are notes, not differences."""
    verdict = Verdict()
    only = {
        side: sorted(set(mine.get("benchmarks") or {}) - set(other.get("benchmarks") or {}))
        for side, mine, other in (("A", a, b), ("B", b, a))
    }
    for side, names in only.items():
        if names:
            verdict.notes.append(f"only in {side}: {', '.join(names)} (left out, and the average with them)")
    one_sided = {f"benchmarks.{name}" for names in only.values() for name in names}
    flat_a, flat_b = flatten(a), flatten(b)
    for key in sorted(set(flat_a) | set(flat_b)):
        if any(key == head or key.startswith(head + ".") for head in one_sided):
            continue
        left, right = flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)
        if left != right:
            verdict.differences.append(Difference(key, left, right, *rule_of(key)))
    for key in ("retriever.index_digest",):
        if key in flat_a and flat_a[key] is None and flat_b.get(key, _ABSENT) is None:
            verdict.notes.append(f"{key} unknown in both (a remote service that does not report it): not checked")
    return verdict


def compare(a: Report, b: Report) -> Verdict:
    """The verdict on two reports; a missing `pinned` section is a refusal that `--force` overrides."""
    if a.pinned is not None and b.pinned is not None:
        return compare_pinned(a.pinned, b.pinned)
    verdict = Verdict()
    for side, report in (("A", a), ("B", b)):
        if report.pinned is None:
            why = "written before dspo pinned its reports: its settings cannot be checked"
            verdict.differences.append(Difference(f"pinned ({side}: {report.path})", "-", "-", REFUSE, why))
    return verdict


# ------------------------------------------------------------------------------------------------ the table
def _percent(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}"


def _delta(a: Any, b: Any) -> str:
    return "-" if a is None or b is None else f"{100 * (float(b) - float(a)):+.1f}"


def side_by_side(a: Report, b: Report, verdict: Verdict, with_judge: bool) -> str:
    """Markdown: per benchmark both reports' n and scores and B - A in points; rows with a forced difference end in
    `!`. Benchmarks of one report only, and then the average, are left out."""
    names = [name for name in a.rows if name in b.rows and name != AVERAGE]
    if AVERAGE in a.rows and AVERAGE in b.rows and set(a.rows) == set(b.rows):
        names.append(AVERAGE)
    scores = SCORES + (JUDGE_SCORES if with_judge else ())
    header = "| benchmark | n A | n B |" + "".join(f" {label} A | {label} B | Δ |" for _, label in scores)
    lines = [header, "|---|" + "---:|" * (2 + 3 * len(scores))]
    forced = {d.key.split(".")[1] for d in verdict.of(REFUSE) if d.key.startswith("benchmarks.")}
    for name in names:
        row_a, row_b = a.rows[name], b.rows[name]
        label = (f"**{name}**" if name == AVERAGE else name) + (" !" if name in forced else "")
        cells = [label, str(int(row_a.get("n", 0))), str(int(row_b.get("n", 0)))]
        for key, _ in scores:
            left, right = row_a.get(key), row_b.get(key)
            cells += [_percent(left), _percent(right), _delta(left, right)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(a: Report, b: Report, verdict: Verdict, force: bool) -> str:
    """What `--compare` prints when it compares: the sources, the table, then the differences by rule."""
    judged = all(any("judge" in row for row in r.rows.values()) for r in (a, b))
    with_judge = judged and (not verdict.of(JUDGE) or force)
    out = [f"A: {a.path}", f"B: {b.path}", "", side_by_side(a, b, verdict, with_judge)]
    for difference in verdict.of(REFUSE):
        out.append(f"! {difference.line()}  [forced: {difference.why}]")
    if verdict.of(JUDGE):
        shown = "shown (forced)" if force else "left out"
        out += [f"judge: {d.line()}" for d in verdict.of(JUDGE)] + [f"the judges differ: their columns are {shown}"]
    out += [f"warning: {d.line()} ({d.why})" for d in verdict.of(WARN)]
    out += [f"{d.line()} ({d.why})" for d in verdict.of(ALLOW)]
    out += [f"note: {note}" for note in verdict.notes]
    return "\n".join(line for line in out).rstrip() + "\n"


def refusal(verdict: Verdict) -> str:
    lines = ["dspo-eval --compare: refused: these differ and change the numbers:"]
    lines += [f"  {d.line()}  ({d.why})" for d in verdict.of(REFUSE)]
    lines.append("--force prints the tables anyway, these marked (docs/evaluation.md#comparing-two-reports)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when the reports were compared (or forced), 2 when refused or unreadable."""
    parser = argparse.ArgumentParser(prog="dspo-eval", usage=USAGE, description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), required=True, help="two reports")
    parser.add_argument("--force", action="store_true", help="print even when a setting that decides them differs")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        a, b = (read_report(given) for given in args.compare)
    except (OSError, ValueError) as error:
        print(f"dspo-eval --compare: {error}", file=sys.stderr)
        return 2
    verdict = compare(a, b)
    if verdict.refused and not args.force:
        print(refusal(verdict), file=sys.stderr)
        return 2
    print(render(a, b, verdict, args.force), end="")
    return 0
