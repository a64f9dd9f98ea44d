"""An Optuna search of dspo (`dspo-train -m experiment=search_toy`) read back from its folder: every trial's
parameters and score, the best trial, and Optuna's optimization-history figure.

    python bench/search_figure.py SEARCH_DIR [--figure docs/search_toy.png] [--json outputs/bench/search_toy.json]

Hydra's Optuna sweeper keeps its study in memory (`hydra.sweeper.storage: null`), so the study is rebuilt here from
what the search wrote: the search space (a trial's `.hydra/hydra.yaml`, `hydra.sweeper.params`, parsed by the
sweeper's own code), each trial's parameters (`<trial>/.hydra/overrides.yaml`) and score (`<trial>/status.json`: the
mean over `trial_seeds`, with each seed's value). The sweeper's own best (`optimization_results.yaml`) is kept
beside it in the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf


def trials(search: Path) -> tuple[dict, list[dict]]:
    """(the search space as distributions, one record per trial: number, params, value, seed values, state)."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    sweeper = sweeper_config(search)
    space, _ = create_params_from_overrides([f"{key}={value}" for key, value in sweeper.params.items()])
    records = []
    for folder in sorted((p for p in search.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        overrides = dict(str(o).split("=", 1) for o in OmegaConf.load(folder / ".hydra" / "overrides.yaml"))
        status = json.loads((folder / "status.json").read_text()) if (folder / "status.json").is_file() else {}
        params = {key: _value(overrides[key], space[key]) for key in space}
        record = {"number": int(folder.name), "params": params, "value": status.get("metric")}
        records.append({**record, "seed_values": status.get("seed_metrics"), "state": status.get("state", "missing")})
    return space, records


def sweeper_config(search: Path):
    """`hydra.sweeper` of the search: from a trial's `.hydra/hydra.yaml` (Optuna's sweeper writes no multirun.yaml)."""
    for path in [search / "multirun.yaml", *sorted(search.glob("*/.hydra/hydra.yaml"))]:
        if path.is_file():
            return OmegaConf.load(path).hydra.sweeper
    raise SystemExit(f"bench/search_figure.py: {search} holds no trial (<n>/.hydra/hydra.yaml): not a search folder")


def _value(text: str, distribution) -> float | int | str:
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        return next(c for c in choices if str(c) == text)
    return float(text)


def study_of(space: dict, records: list[dict], direction: str):
    """An in-memory Optuna study holding the finished trials (those with a score)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=direction)
    for record in records:
        if record["value"] is not None:
            trial = optuna.trial.create_trial(params=record["params"], distributions=space, value=record["value"])
            study.add_trial(trial)
    return study


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("search", type=Path, help="the search folder (outputs/search/<timestamp>)")
    parser.add_argument("--figure", type=Path, default=Path("outputs/bench/search_toy.png"))
    parser.add_argument("--json", type=Path, default=Path("outputs/bench/search_toy.json"))
    args = parser.parse_args(argv)
    direction = str(sweeper_config(args.search).direction).lower()
    space, records = trials(args.search)
    study = study_of(space, records, "minimize" if "min" in direction else "maximize")
    if not study.trials:
        raise SystemExit(f"bench/search_figure.py: no trial of {args.search} has a score (status.json metric)")
    best = study.best_trial
    result = {"trials": records, "best": {"number": best.number, "params": best.params, "value": best.value}}
    sweeper_best = args.search / "optimization_results.yaml"
    if sweeper_best.is_file():
        result["sweeper_best_value"] = float(OmegaConf.load(sweeper_best).best_value)
    for record in records:
        seeds = record["seed_values"] or {}
        shown = " ".join(f"{k}:{v:.3f}" for k, v in seeds.items() if v is not None)
        print(f"trial {record['number']}: {record['value']} (seeds {shown}) {record['params']}")
    print(f"best: trial {best.number} {best.value:.4f} {best.params}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    _figure(study, args.figure)


def _figure(study, path: Path) -> None:
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization.matplotlib import plot_optimization_history

    with warnings.catch_warnings():  # "experimental" since optuna 2.2: the figure is what it draws
        warnings.simplefilter("ignore")
        axes = plot_optimization_history(study)
    axes.set_ylabel("val/subem_mean (mean over trial_seeds)")
    path.parent.mkdir(parents=True, exist_ok=True)
    axes.figure.savefig(path, dpi=110, bbox_inches="tight")
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
