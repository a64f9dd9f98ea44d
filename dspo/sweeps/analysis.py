"""Read dspo runs back from disk: TensorBoard scalars -> pandas -> curves over seeds, ablation tables, figures.

A run directory is what `dspo-train` writes: `.hydra/config.yaml` (the composed config), `tb/` (TensorBoard event
files) and, for runs that finished, `metrics.yaml`. Single runs live in `outputs/train/<run_name>_<timestamp>/`, sweeps
in `outputs/multirun/<timestamp>/<job_num>_<run_name>/`, with run_name = `<algorithm>_seed<seed>`.

Runs are grouped by algorithm; statistics are taken over the runs of a group (normally its seeds). Steps are aligned
on the union of logged steps without interpolation: a step's statistics use the runs that logged it (column `n`), so a
killed seed shortens the band instead of dropping the whole curve. `std` is the sample standard deviation (ddof=1),
0 for a single run. Smoothing is TensorBoard's debiased exponential moving average, applied per run before averaging.

Figures are built on `matplotlib.figure.Figure` (Agg canvas), never through pyplot: no global backend is switched, so
the same code works headless and inline in Jupyter (`%matplotlib inline` renders the returned figure).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

SCALAR_COLUMNS = ["step", "tag", "value"]
CURVE_COLUMNS = ["algorithm", "step", "mean", "std", "min", "max", "n"]
# <job_num>_<algorithm>_seed<seed> (multirun) or <algorithm>_seed<seed>_<YYYYmmdd-HHMMSS> (single run)
_DIR_NAME = re.compile(r"^(?:\d+_)?(?P<algorithm>.+?)_seed(?P<seed>\d+)(?:_\d{8}-\d{6})?$")
_EVENT_GLOB = "events.out.tfevents*"


@dataclass(frozen=True)
class RunInfo:
    """One training run on disk. `seed` is None when neither the config nor the directory name gives one."""

    dir: Path
    algorithm: str
    seed: int | None
    run_name: str


def _is_run_dir(path: Path) -> bool:
    return (path / ".hydra" / "config.yaml").is_file() or (path / "tb").is_dir()


def _read_config(path: Path, extra: Sequence[str] = ()) -> dict[str, object]:
    """`algorithm.name`, `seed`, `run_name` (and the `extra` keys) from `.hydra/config.yaml`; absent or unresolvable
    keys are left out.

    OmegaConf resolves `run_name: ${algorithm.name}_seed${seed}`; keys that need Hydra's runtime resolvers
    (`output_dir: ${hydra:...}`) are never touched.
    """
    from omegaconf import OmegaConf

    config = path / ".hydra" / "config.yaml"
    if not config.is_file():
        return {}
    try:
        cfg = OmegaConf.load(config)
    except Exception as err:  # a truncated file from a killed run must not hide the other runs: use the dir name
        warnings.warn(f"{config}: cannot parse ({err}); using the directory name instead", stacklevel=3)
        return {}
    out: dict[str, object] = {}
    for key in ("algorithm.name", "seed", "run_name", *extra):
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if value is not None:
            out[key] = value
    return out


def run_info(path: str | Path, by: str | None = None) -> RunInfo:
    """Describe one run directory: config first, then the directory name (`<algo>_seed<k>`), then the bare name.
    `by`: a config key whose value groups the run instead of its algorithm (`<key>=<value>`; a sweep over a weight)."""
    path = Path(path)
    cfg = _read_config(path, (by,) if by else ())
    match = _DIR_NAME.match(path.name)
    algorithm = cfg.get("algorithm.name") or (match["algorithm"] if match else path.name)
    if by:
        algorithm = f"{by}={cfg.get(by, 'unset')}"
    seed = cfg.get("seed", int(match["seed"]) if match else None)
    seed = int(seed) if seed is not None else None
    run_name = cfg.get("run_name") or (f"{algorithm}_seed{seed}" if seed is not None else path.name)
    return RunInfo(dir=path, algorithm=str(algorithm), seed=seed, run_name=str(run_name))


def find_runs(path: str | Path, by: str | None = None) -> list[RunInfo]:
    """All runs at or below `path` (a run directory, a sweep directory, or any parent such as `outputs/`).

    A run directory holds `.hydra/config.yaml` or `tb/`; the search does not descend into runs. Sorted by
    (algorithm, seed, directory); `by`: grouped by that config key's value instead of the algorithm (`run_info`).
    Raises FileNotFoundError when `path` is missing or holds no run.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"run path {root} is not a directory (resolved from {Path.cwd()}: {root.absolute()}); pass a run, sweep "
            "or outputs directory, as an absolute path from a notebook (its kernel runs in notebooks/)"
        )
    found: list[RunInfo] = []
    stack = [root]
    while stack:
        current = stack.pop()
        if _is_run_dir(current):
            found.append(run_info(current, by))
            continue
        stack.extend(p for p in current.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise FileNotFoundError(
            f"no dspo run under {root.absolute()} (a run directory holds .hydra/config.yaml or tb/); point it at "
            "outputs/, outputs/multirun/<timestamp>/ or outputs/train/<run>/"
        )
    return sorted(found, key=lambda r: (r.algorithm, -1 if r.seed is None else r.seed, str(r.dir)))


def _event_dirs(run_dir: Path) -> list[Path]:
    """Directories holding event files: `tb/` (and its version folders) or, failing that, anywhere in the run."""
    base = run_dir / "tb" if (run_dir / "tb").is_dir() else run_dir
    return sorted({f.parent for f in base.rglob(_EVENT_GLOB)})


def _scalar_events(accumulator) -> list[tuple[int, str, float]]:
    """Scalars from an EventAccumulator: `simple_value` summaries (torch SummaryWriter, Lightning) and TF2-style
    scalar tensors (tensorboard.summary.Writer). Text and other tensor summaries are skipped."""
    from tensorboard.util import tensor_util

    tags = accumulator.Tags()
    rows = [(e.step, tag, float(e.value)) for tag in tags.get("scalars", []) for e in accumulator.Scalars(tag)]
    for tag in tags.get("tensors", []):
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        for event in accumulator.Tensors(tag):
            array = tensor_util.make_ndarray(event.tensor_proto)
            if array.size == 1 and array.dtype.kind in "fiub":
                rows.append((event.step, tag, float(array.reshape(-1)[0])))
    return rows


def scalar_wall_times(run_dir: str | Path) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, wall time, value)]} of every scalar summary, sorted by step; for timing runs (`load_scalars` keeps
    the values only). Wall times are the event files' `time.time()` stamps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float, float]]] = {}
    for directory in _event_dirs(Path(run_dir)):
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            found.setdefault(tag, []).extend((e.step, e.wall_time, float(e.value)) for e in accumulator.Scalars(tag))
    return {tag: sorted(rows) for tag, rows in found.items()}


def load_scalars(run_dir: str | Path) -> pd.DataFrame:
    """Every scalar of a run as a DataFrame with columns step, tag, value, sorted by (tag, step).

    A step logged twice (a resumed run re-logging) keeps the value written last. Empty frame when the run has no
    event files yet.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    rows: list[tuple[int, str, float]] = []
    for directory in _event_dirs(run_dir):
        # size_guidance 0 = keep every event (the default samples scalars down to 10k)
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        rows.extend(_scalar_events(accumulator))
    frame = pd.DataFrame(rows, columns=SCALAR_COLUMNS).astype({"step": "int64", "value": "float64"})
    frame = frame.drop_duplicates(["tag", "step"], keep="last")
    return frame.sort_values(["tag", "step"], kind="stable").reset_index(drop=True)


_SCALAR_CACHE: dict[tuple, pd.DataFrame] = {}


def _scalars_cached(run_dir: Path) -> pd.DataFrame:
    """load_scalars, re-read only when an event file changed (a notebook calls it once per plotted tag)."""
    files = sorted(run_dir.rglob(_EVENT_GLOB))
    key = (str(run_dir.resolve()), tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _SCALAR_CACHE:
        _SCALAR_CACHE[key] = load_scalars(run_dir)
    return _SCALAR_CACHE[key]


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: exponential moving average with weight in [0, 1), debiased for the first points."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing={weight}: must be in [0, 1) (0 = raw values, 0.9 = heavy)")
    out, last = [], 0.0
    for num, value in enumerate(values, start=1):
        last = last * weight + (1.0 - weight) * float(value)
        out.append(last / (1.0 - weight**num))
    return out


def run_series(run: RunInfo, tag: str, smoothing: float = 0.0) -> pd.Series:
    """One run's values of `tag`, indexed by step (empty when the run never logged it)."""
    scalars = _scalars_cached(run.dir)
    rows = scalars[scalars["tag"] == tag]
    values = smooth(rows["value"].tolist(), smoothing) if smoothing else rows["value"].tolist()
    return pd.Series(values, index=rows["step"].to_numpy(), name=run.run_name, dtype="float64")


def last_step(run: RunInfo) -> int | None:
    """The largest step at which the run logged any scalar (None before its first event file)."""
    steps = _scalars_cached(run.dir)["step"]
    return int(steps.max()) if len(steps) else None


def curves(runs: Sequence[RunInfo], tag: str, smoothing: float = 0.0) -> pd.DataFrame:
    """Per algorithm and step: mean, std (ddof=1; 0 for one run), min, max and n over its runs, for `tag`.

    Columns: algorithm, step, mean, std, min, max, n. Algorithms that never logged `tag` are absent; the frame is
    empty (with these columns) when no run logged it.
    """
    frames = []
    for algorithm in sorted({r.algorithm for r in runs}):
        series = [run_series(r, tag, smoothing) for r in runs if r.algorithm == algorithm]
        series = [s for s in series if not s.empty]
        if not series:
            continue
        table = pd.concat(series, axis=1, keys=range(len(series))).sort_index()  # [steps, runs]
        stats = pd.DataFrame(
            {
                "algorithm": algorithm,
                "step": table.index.astype("int64"),
                "mean": table.mean(axis=1).to_numpy(),
                "std": table.std(axis=1, ddof=1).fillna(0.0).to_numpy(),
                "min": table.min(axis=1).to_numpy(),
                "max": table.max(axis=1).to_numpy(),
                "n": table.notna().sum(axis=1).to_numpy(),
            }
        )
        frames.append(stats)
    if not frames:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    return pd.concat(frames, ignore_index=True)[CURVE_COLUMNS]


def available_tags(runs: Sequence[RunInfo], pattern: str = ".*") -> list[str]:
    """Sorted scalar tags logged by any run that fully match the regular expression `pattern`."""
    regex = re.compile(pattern)
    tags = {t for r in runs for t in _scalars_cached(r.dir)["tag"].unique() if regex.fullmatch(t)}
    return sorted(tags)


def final_values(run: RunInfo, stage: str = "test") -> dict[str, float]:
    """Last logged value of every `<stage>/...` scalar of a run; `metrics.yaml` fills tags absent from the events."""
    scalars = _scalars_cached(run.dir)
    rows = scalars[scalars["tag"].str.startswith(f"{stage}/")]
    values = {tag: float(group["value"].iloc[-1]) for tag, group in rows.groupby("tag", sort=True)}
    metrics_file = run.dir / "metrics.yaml"
    if metrics_file.is_file():
        import yaml

        metrics = yaml.safe_load(metrics_file.read_text()) or {}
        for tag, value in metrics.items():
            if str(tag).startswith(f"{stage}/") and isinstance(value, (int, float)):
                values.setdefault(str(tag), float(value))
    return values


def final_table(runs: Sequence[RunInfo], stage: str = "test", metric: str = "subem") -> pd.DataFrame:
    """Ablation table: one row per algorithm, columns (benchmark, "mean"/"std") of `<stage>/<benchmark>/<metric>`.

    Benchmarks are sorted, followed by ("avg", ...) from `<stage>/<metric>_mean` when logged, then ("n", "") = the
    number of runs with at least one such value. std is ddof=1 (NaN for a single run). Runs with no value (a run
    killed before testing) are left out; the frame is empty when no run has any.
    """
    pattern = re.compile(rf"^{re.escape(stage)}/(?P<bench>[^/]+)/{re.escape(metric)}$")
    records = []
    for run in runs:
        values = final_values(run, stage)
        row = {m["bench"]: v for tag, v in values.items() if (m := pattern.match(tag))}
        if f"{stage}/{metric}_mean" in values:
            row["avg"] = values[f"{stage}/{metric}_mean"]
        if row:
            records.append({"algorithm": run.algorithm, **row})
    if not records:
        return pd.DataFrame()
    frame = pd.DataFrame.from_records(records)
    benches = sorted(c for c in frame.columns if c not in ("algorithm", "avg"))
    columns = benches + (["avg"] if "avg" in frame.columns else [])
    grouped = frame.groupby("algorithm", sort=True)
    table = pd.concat({c: grouped[c].agg(["mean", "std"]) for c in columns}, axis=1)
    table[("n", "")] = grouped.size()
    table.index.name = "algorithm"
    return table


def format_table(table: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """final_table as strings `mean ± std` (just `mean` for a single run), one column per benchmark, plus n."""
    if table.empty:
        return table
    out = pd.DataFrame(index=table.index)
    for bench in dict.fromkeys(c[0] for c in table.columns if c[0] != "n"):
        mean, std = table[(bench, "mean")], table[(bench, "std")]
        out[bench] = [
            "" if pd.isna(m) else f"{m:.{digits}f}" if pd.isna(s) else f"{m:.{digits}f} ± {s:.{digits}f}"
            for m, s in zip(mean, std, strict=True)
        ]
    out["n"] = table[("n", "")].astype(int)
    return out


def plot_curves(
    runs: Sequence[RunInfo],
    tags: str | Sequence[str],
    smoothing: float = 0.0,
    spread: str = "std",
    path: str | Path | None = None,
    ncols: int = 3,
):
    """One panel per tag: each algorithm's mean over runs with a band (`spread`="std": mean ± std, "minmax": min to
    max, "none"). Saves a PNG to `path` when given (parent folders created). Returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    if spread not in ("std", "minmax", "none"):
        raise ValueError(f"spread={spread!r}: use 'std', 'minmax' or 'none'")
    tags = [tags] if isinstance(tags, str) else list(tags)
    if not tags:
        raise ValueError("plot_curves: no tags given; pass e.g. ['train/reward_mean']")
    ncols = max(1, min(ncols, len(tags)))
    nrows = -(-len(tags) // ncols)
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).reshape(-1)
    algorithms = sorted({r.algorithm for r in runs})
    colors = {a: f"C{i % 10}" for i, a in enumerate(algorithms)}
    for ax, tag in zip(axes, tags, strict=False):
        _draw_panel(ax, curves(runs, tag, smoothing), tag, spread, colors)
    for ax in axes[len(tags) :]:
        ax.set_visible(False)
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _draw_panel(ax, frame: pd.DataFrame, tag: str, spread: str, colors: dict[str, str]) -> None:
    ax.set_title(tag, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if frame.empty:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    for algorithm, group in frame.groupby("algorithm", sort=True):
        n = int(group["n"].max())
        marker = "." if len(group) <= 30 else None  # points help sparse validation curves, clutter dense ones
        ax.plot(group["step"], group["mean"], color=colors[algorithm], label=f"{algorithm} (n={n})", marker=marker)
        if spread == "std":
            ax.fill_between(group["step"], group["mean"] - group["std"], group["mean"] + group["std"], alpha=0.2,
                            color=colors[algorithm])  # fmt: skip
        elif spread == "minmax":
            ax.fill_between(group["step"], group["min"], group["max"], alpha=0.2, color=colors[algorithm])
    ax.legend(fontsize=8)


# The notebook's figures: its environment variable -> the README figure of that name in docs/
SHIPPED_FIGURES = {"DSPO_FIGURE": "sweep.png", "DSPO_ABLATION_FIGURE": "ablation.png"}
UPDATE_SHIPPED_VAR = "DSPO_UPDATE_SHIPPED"


def figure_paths(run_dir: str | Path, env: Mapping[str, str] | None = None) -> dict[str, Path | None]:
    """Where the notebook saves each figure (keyed by its variable in SHIPPED_FIGURES; None = not saved).

    The variable's path when set (empty = no file), else `<run_dir>/figures/<name>`, next to the runs it shows. The
    README's tracked `docs/<name>` only with DSPO_UPDATE_SHIPPED=1 (then the default); naming a file in docs/ without
    it is refused, so following the docs never replaces the README's figures with a test sweep.
    """
    env = os.environ if env is None else env
    update = env.get(UPDATE_SHIPPED_VAR, "").lower() in ("1", "true", "yes")
    docs = (Path(__file__).resolve().parents[2] / "docs").resolve()
    paths: dict[str, Path | None] = {}
    for var, name in SHIPPED_FIGURES.items():
        value = env.get(var)
        if value == "":
            paths[var] = None
            continue
        default = docs / name if update else Path(run_dir) / "figures" / name
        path = Path(value).expanduser() if value is not None else default
        if not update and path.absolute().resolve().is_relative_to(docs):
            raise ValueError(
                f"{var}: {path} is in the repository's docs/ (the README's figures); set {UPDATE_SHIPPED_VAR}=1 to "
                f"replace them, or unset {var} to write {Path(run_dir) / 'figures' / name}"
            )
        paths[var] = path
    return paths


def runs_frame(runs: Sequence[RunInfo]) -> pd.DataFrame:
    """The runs as a table (algorithm, seed, run_name, dir, finished = metrics.yaml present) for display."""
    return pd.DataFrame(
        [
            {
                "algorithm": r.algorithm,
                "seed": r.seed,
                "run_name": r.run_name,
                "dir": str(r.dir),
                "finished": (r.dir / "metrics.yaml").is_file(),
            }
            for r in runs
        ]
    )


# Student t quantiles t(0.975, df), df = 1..30 (standard table values); larger df use 1.96
_T975 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
]  # fmt: skip


def ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % Student-t interval); half-width NaN for fewer than 2 values."""
    data = [float(v) for v in values if not math.isnan(float(v))]
    if not data:
        return math.nan, math.nan
    mean = sum(data) / len(data)
    if len(data) < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in data) / (len(data) - 1))
    df = len(data) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    return mean, t * sd / math.sqrt(len(data))
