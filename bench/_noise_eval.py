"""Accuracy against search noise (issue 57, RE-Searcher's claim of robustness to misleading results): each run's
trained model and the warm start it began from, greedy on the toy's test questions, with every search result replaced
by a misleading page with probability p for each p of `--noise-eval` (env=simulated's scripted distractors, the key
`env.tools.search.noise`). Used by `bench/environments.py --noise-eval 0 0.3 0.5 0.7`.

One engine serves every model (they share the toy's architecture and tokenizer): it is built on the first warm start
and each later model's weights are pushed into it, as training pushes them. Each model is scored in its run's own
environment (the run's overrides, env=goal_reflect or env=simulated) at each noise; the noise draws are seeded alike for
every model (`env.tools.search.seed`), so at a given p two models see the same misleading page for the same query.
"""

from __future__ import annotations

import math
from pathlib import Path

NOISE_SEED = 0  # env.tools.search.seed of every evaluation: the same draws for the same query, whichever the model
SIGNALS = ("reward/reflect_right", "reward/held_share", "reward/goal_share")  # where the environment reports them


def has_noise(overrides: list[str]) -> bool:
    """Whether the environment `overrides` compose has a noisy search tool (env=simulated, env=goal_reflect)."""
    from omegaconf import OmegaConf

    from dspo.toy.rebuild import compose_train

    return OmegaConf.select(compose_train(overrides), "env.tools.search.noise", default="absent") != "absent"


def run_overrides(run_dir: Path) -> list[str]:
    """The dspo-train overrides a run was composed with (its .hydra/overrides.yaml), less hydra's and the noise."""
    import yaml

    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "env.tools.search.noise="))]


def model_weights(model_dir: Path) -> list[tuple[str, object]]:
    """The named tensors of a saved model folder as training pushes them: the loaded model's state dict, so a tied
    output layer (`lm_head.weight`, stored once in the file) is pushed under its own name too. Safetensors only."""
    import torch
    from transformers import AutoModelForCausalLM

    if not sorted(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (an exported dspo model folder has them)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True)
    return list(model.state_dict().items())


def score(engine, tokenizer, overrides: list[str], noise: float) -> dict[str, float]:
    """Greedy test subEM (outcomes, not rewards), searches and the environment's signals per test benchmark, with
    the model in `engine`, under the environment `overrides` compose at `noise`."""
    from hydra.utils import instantiate

    from dspo.agent import build_agent
    from dspo.data.qa import load_qa
    from dspo.toy.rebuild import compose_train

    cfg = compose_train([*overrides, f"env.tools.search.noise={noise}", f"env.tools.search.seed={NOISE_SEED}"])
    env = instantiate(cfg.env)
    agent = build_agent(instantiate(cfg.rollout.agent), engine=engine, tokenizer=tokenizer, env=env)
    numbers: dict[str, float] = {}
    for name, path in cfg.data.test_files.items():
        items = load_qa(path, benchmark=name, limit=cfg.data.test_limit)
        result = agent.rollout(items, group_size=1, policy_version=0, greedy=True)
        runs = [group.trajectories[0] for group in result.groups]
        numbers[f"{name}/subem"] = sum(t.outcome for t in runs) / len(runs)
        numbers[f"{name}/searches"] = sum(t.num_tool_calls for t in runs) / len(runs)
        for signal in SIGNALS:
            if signal in result.stats:
                numbers[f"{name}/{signal.removeprefix('reward/')}"] = float(result.stats[signal])
    return numbers


def noise_eval(root: Path, setups: dict[str, list[str]], levels: list[float], extra: list[str]) -> dict[str, dict]:
    """{setup: {"levels", "warm_start": {p: numbers}, "runs": {seed: {p: numbers}}, "mean_ci95": {p: {key: (mean,
    half-width)}}}} for the setups with finished runs under `root`."""
    from hydra.utils import instantiate

    from dspo.sweeps.analysis import find_runs
    from dspo.sweeps.report import ci95
    from dspo.toy.rebuild import compose_train
    from dspo.toy.tokenizer import load_tokenizer

    engine = tokenizer = None
    version = 0
    result: dict[str, dict] = {}
    for name, setup in setups.items():
        try:
            runs = [r for r in find_runs(root / name) if (r.dir / "model").is_dir()]
        except FileNotFoundError:
            continue
        if not runs:
            continue
        cfg = compose_train([*setup, *extra])
        _, warm_start = instantiate(cfg.prepare.toyworld)  # cached: the warm start the runs began from
        models = [("warm_start", Path(warm_start), [*setup, *extra])]
        models += [(f"seed{r.seed}", r.dir / "model", run_overrides(r.dir)) for r in runs]
        entry: dict = {"levels": levels, "warm_start": {}, "runs": {}}
        for label, model_dir, overrides in models:
            if engine is None:
                engine = instantiate(cfg.rollout.engine)(model_path=str(model_dir))
                tokenizer = load_tokenizer(str(model_dir))
            else:
                version += 1
                engine.push_weights(model_weights(model_dir), version)
            scores = {str(p): score(engine, tokenizer, overrides, p) for p in levels}
            print(f"[noise {name} {label}] " + "  ".join(f"p={p}: {_brief(s)}" for p, s in scores.items()), flush=True)
            if label == "warm_start":
                entry["warm_start"] = scores
            else:
                entry["runs"][label] = scores
        entry["mean_ci95"] = {
            p: {k: ci95([run[p].get(k, math.nan) for run in entry["runs"].values()]) for k in entry["warm_start"][p]}
            for p in entry["warm_start"]
        }
        result[name] = entry
    return result


def _brief(numbers: dict[str, float]) -> str:
    subem = {k.split("/")[0].removeprefix("toy_"): v for k, v in numbers.items() if k.endswith("/subem")}
    return " ".join(f"{name} {value:.2f}" for name, value in subem.items())


def print_noise(result: dict[str, dict]) -> None:
    for name, entry in result.items():
        print(f"\n{name}: greedy test subEM against search noise (warm start -> trained, mean ± 95 % half-width)")
        for p, means in entry["mean_ci95"].items():
            cells = []
            for key, (mean, half) in means.items():
                if key.endswith("/subem"):
                    start = entry["warm_start"][p][key]
                    cells.append(f"{key.split('/')[0]} {start:.3f} -> {mean:.3f} ± {half:.3f}")
            print(f"  p={p}: " + "   ".join(cells))


def plot_noise(result: dict[str, dict], path: Path) -> None:
    """Test subEM against noise per benchmark: each setup's warm start (dashed) and trained runs (mean, seed range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = sorted({k.split("/")[0] for e in result.values() for k in next(iter(e["warm_start"].values()))})
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(5 * len(benchmarks), 3.8), squeeze=False)
    for ax, bench in zip(axes[0], benchmarks):
        for i, (name, entry) in enumerate(result.items()):
            levels = list(entry["mean_ci95"])
            xs = [float(p) for p in levels]
            key = f"{bench}/subem"
            per_run = [[run[p][key] for p in levels] for run in entry["runs"].values()]
            mean = [sum(col) / len(col) for col in zip(*per_run)]
            ax.plot(xs, mean, color=f"C{i}", marker="o", label=f"{name}, trained (n={len(per_run)})")
            low, high = [min(c) for c in zip(*per_run)], [max(c) for c in zip(*per_run)]
            ax.fill_between(xs, low, high, color=f"C{i}", alpha=0.15)
            start = [entry["warm_start"][p][key] for p in levels]
            ax.plot(xs, start, color=f"C{i}", ls="--", label=f"{name}, warm start")
        ax.set_title(f"{bench}: greedy test subEM", fontsize=10)
        ax.set_xlabel("search noise (share of misleading results)")
        ax.legend(fontsize=7)
    save_figure(fig, path, "noise figure")


def save_figure(fig, path: Path, what: str = "figure") -> None:
    """Lay out, write (creating the folder) and name the written file."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"{what}: {path}")
