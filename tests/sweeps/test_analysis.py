"""dspo.sweeps.analysis on fake run directories (2 algorithms x 2 seeds) written with torch's SummaryWriter, as
Lightning's
TensorBoardLogger does; numbers are checked against hand-computed means. The last test executes the notebook."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dspo.sweeps import analysis

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "reward_curves.ipynb"

# train/reward_mean at steps 0, 1, 2 per (algorithm, seed); val and test values per benchmark
REWARD = {
    ("dspo", 0): [0.1, 0.3, 0.5],
    ("dspo", 1): [0.3, 0.5, 0.9],
    ("grpo", 0): [0.0, 0.2, 0.2],
    ("grpo", 1): [0.2, 0.2, 0.4],
}
TEST = {
    ("dspo", 0): {"hotpotqa": 0.4, "nq": 0.6},
    ("dspo", 1): {"hotpotqa": 0.6, "nq": 0.8},
    ("grpo", 0): {"hotpotqa": 0.2, "nq": 0.3},
    ("grpo", 1): {"hotpotqa": 0.3, "nq": 0.5},
}
CONFIG = """algorithm:
  _target_: dspo.algorithms.config.AlgorithmConfig
  name: {algorithm}
seed: {seed}
run_name: ${{algorithm.name}}_seed${{seed}}
output_dir: ${{hydra:runtime.output_dir}}
"""


def write_run(run_dir: Path, algorithm: str, seed: int, with_config: bool = True) -> None:
    """A run directory as dspo-train leaves it: .hydra/config.yaml (unresolved, as Hydra saves it) and tb/ events."""
    from torch.utils.tensorboard import SummaryWriter

    if with_config:
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "config.yaml").write_text(CONFIG.format(algorithm=algorithm, seed=seed))
    writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    for step, reward in enumerate(REWARD[(algorithm, seed)]):
        writer.add_scalar("train/reward_mean", reward, step)
        writer.add_scalar("rollout/keep_rate", 0.5 + 0.1 * seed, step)
    for bench, value in TEST[(algorithm, seed)].items():
        writer.add_scalar(f"val/{bench}/subem", value / 2, 1)
        writer.add_scalar(f"val/{bench}/subem", value, 2)
        writer.add_scalar(f"test/{bench}/subem", value, 2)
        writer.add_scalar(f"test/{bench}/em", value / 2, 2)
    mean = sum(TEST[(algorithm, seed)].values()) / 2
    writer.add_scalar("val/subem_mean", mean / 2, 1)
    writer.add_scalar("val/subem_mean", mean, 2)
    writer.add_scalar("test/subem_mean", mean, 2)
    writer.add_text("samples/trajectory", "<tool_call>not a scalar</tool_call>", 0)
    writer.close()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """outputs/multirun/<ts>/<job>_<algo>_seed<k>/ for dspo, grpo x seeds 0, 1."""
    root = tmp_path_factory.mktemp("outputs") / "multirun" / "20250101-000000"
    for job, (algorithm, seed) in enumerate(sorted(REWARD)):
        write_run(root / f"{job}_{algorithm}_seed{seed}", algorithm, seed)
    return root


def test_find_runs_reads_config_and_sorts(sweep: Path) -> None:
    runs = analysis.find_runs(sweep.parent.parent)  # from outputs/, two levels above the runs
    assert [(r.algorithm, r.seed, r.run_name) for r in runs] == [
        ("dspo", 0, "dspo_seed0"),
        ("dspo", 1, "dspo_seed1"),
        ("grpo", 0, "grpo_seed0"),
        ("grpo", 1, "grpo_seed1"),
    ]
    single = analysis.find_runs(runs[2].dir)
    assert len(single) == 1 and single[0].dir == runs[2].dir


def test_find_runs_falls_back_to_directory_name(tmp_path: Path) -> None:
    write_run(tmp_path / "train" / "grpo_seed1_20250102-030405", "grpo", 1, with_config=False)
    write_run(tmp_path / "multirun" / "x" / "3_dspo_seed0", "dspo", 0, with_config=False)
    runs = analysis.find_runs(tmp_path)
    assert [(r.algorithm, r.seed, r.run_name) for r in runs] == [("dspo", 0, "dspo_seed0"), ("grpo", 1, "grpo_seed1")]


def test_find_runs_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no dspo run under"):
        analysis.find_runs(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing"):
        analysis.find_runs(tmp_path / "missing")


def test_load_scalars_frame(sweep: Path) -> None:
    frame = analysis.load_scalars(sweep / "0_dspo_seed0")
    assert list(frame.columns) == ["step", "tag", "value"]
    reward = frame[frame["tag"] == "train/reward_mean"]
    assert reward["step"].tolist() == [0, 1, 2]
    assert reward["value"].tolist() == pytest.approx([0.1, 0.3, 0.5])
    assert "samples/trajectory" not in set(frame["tag"])  # text summaries are not scalars


def test_load_scalars_reads_tensor_scalars(tmp_path: Path) -> None:
    """tensorboard.summary.Writer writes TF2-style tensor scalars; a resumed run re-logging a step keeps the last."""
    from tensorboard.summary import Writer

    writer = Writer(str(tmp_path / "tb"))
    for step, value in [(0, 1.0), (1, 2.0), (1, 5.0)]:
        writer.add_scalar("train/loss", value, step)
    writer.close()
    frame = analysis.load_scalars(tmp_path)
    assert frame["step"].tolist() == [0, 1]
    assert frame["value"].tolist() == pytest.approx([1.0, 5.0])


def test_curves_mean_std_over_seeds(sweep: Path) -> None:
    runs = analysis.find_runs(sweep)
    frame = analysis.curves(runs, "train/reward_mean")
    dspo = frame[frame["algorithm"] == "dspo"]
    assert dspo["step"].tolist() == [0, 1, 2]
    assert dspo["mean"].tolist() == pytest.approx([0.2, 0.4, 0.7])
    assert dspo["std"].tolist() == pytest.approx([math.sqrt(0.02), math.sqrt(0.02), math.sqrt(0.08)])
    assert dspo["min"].tolist() == pytest.approx([0.1, 0.3, 0.5])
    assert dspo["max"].tolist() == pytest.approx([0.3, 0.5, 0.9])
    grpo = frame[frame["algorithm"] == "grpo"]
    assert grpo["mean"].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert grpo["n"].tolist() == [2, 2, 2]
    assert analysis.curves(runs, "never/logged").empty


def test_curves_smoothing_and_ragged_seeds(sweep: Path) -> None:
    runs = analysis.find_runs(sweep)
    smoothed = analysis.curves([runs[0]], "train/reward_mean", smoothing=0.5)
    # EMA of 0.1, 0.3, 0.5 with weight 0.5: 0.05, 0.175, 0.3375, debiased by 1 - 0.5**k: /0.5, /0.75, /0.875
    assert smoothed["mean"].tolist() == pytest.approx([0.1, 0.175 / 0.75, 0.3375 / 0.875])
    assert smoothed["std"].tolist() == [0.0, 0.0, 0.0]
    val = analysis.curves(runs, "val/hotpotqa/subem")
    assert val[val["algorithm"] == "grpo"]["mean"].tolist() == pytest.approx([0.125, 0.25])
    with pytest.raises(ValueError, match="smoothing"):
        analysis.curves(runs, "train/reward_mean", smoothing=1.0)


def test_final_table_numbers(sweep: Path) -> None:
    runs = analysis.find_runs(sweep)
    table = analysis.final_table(runs, stage="test")
    assert list(table.index) == ["dspo", "grpo"]
    assert table.loc["dspo", ("hotpotqa", "mean")] == pytest.approx(0.5)
    assert table.loc["dspo", ("hotpotqa", "std")] == pytest.approx(math.sqrt(0.02))
    assert table.loc["grpo", ("nq", "mean")] == pytest.approx(0.4)
    assert table.loc["grpo", ("avg", "mean")] == pytest.approx((0.25 + 0.4) / 2)
    assert table.loc["dspo", ("n", "")] == 2
    assert [c[0] for c in table.columns] == ["hotpotqa", "hotpotqa", "nq", "nq", "avg", "avg", "n"]
    em = analysis.final_table(runs, stage="test", metric="em")
    assert em.loc["dspo", ("nq", "mean")] == pytest.approx(0.35)
    shown = analysis.format_table(table)
    assert shown.loc["dspo", "hotpotqa"] == "0.500 ± 0.141"
    assert shown.loc["grpo", "n"] == 2


def test_final_table_uses_metrics_yaml_and_skips_killed_runs(tmp_path: Path) -> None:
    write_run(tmp_path / "0_dspo_seed0", "dspo", 0)
    (tmp_path / "1_dspo_seed1" / "tb").mkdir(parents=True)  # killed before logging anything
    (tmp_path / "2_gspo_seed0" / "tb").mkdir(parents=True)
    (tmp_path / "2_gspo_seed0" / "metrics.yaml").write_text("test/nq/subem: 0.75\ntrain/loss: 0.1\n")
    table = analysis.final_table(analysis.find_runs(tmp_path))
    assert table.loc["dspo", ("n", "")] == 1
    assert math.isnan(table.loc["dspo", ("nq", "std")])
    assert table.loc["gspo", ("nq", "mean")] == pytest.approx(0.75)
    assert math.isnan(table.loc["gspo", ("hotpotqa", "mean")])
    assert analysis.format_table(table).loc["dspo", "nq"] == "0.600"


def test_plot_curves_saves_png(sweep: Path, tmp_path: Path) -> None:
    runs = analysis.find_runs(sweep)
    out = tmp_path / "fig" / "curves.png"
    fig = analysis.plot_curves(runs, ["train/reward_mean", "val/subem_mean", "never/logged"], path=out, ncols=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["train/reward_mean", "val/subem_mean", "never/logged"]
    assert len(visible[0].get_lines()) == 2  # one mean line per algorithm
    with pytest.raises(ValueError, match="spread"):
        analysis.plot_curves(runs, "train/reward_mean", spread="iqr")


def test_notebook_is_committed_without_outputs() -> None:
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert 'os.environ.get("DSPO_RUN_DIR", "outputs")' in code[0].source


def _venv_kernel(kernels: Path) -> None:
    """A `python3` kernelspec launching this interpreter: JUPYTER_PATH comes first in Jupyter's search, so a user's
    own python3 kernel (another Python, without dspo) cannot be picked instead."""
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}
    (kernels / "python3").mkdir(parents=True)
    (kernels / "python3" / "kernel.json").write_text(json.dumps(spec | {"display_name": "dspo venv"}))


@pytest.mark.slow
def test_notebook_executes_headless(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    _venv_kernel(tmp_path / "jupyter" / "kernels")
    figure = tmp_path / "sweep.png"
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("DSPO_RUN_DIR", str(sweep))
    monkeypatch.setenv("DSPO_FIGURE", str(figure))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # figures render inline
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "0.500 ± 0.141" in html  # the final test table


def test_notebook_figures_go_next_to_the_runs_not_over_the_readme(tmp_path: Path) -> None:
    """The notebook's figure paths (`figure_paths`): `<run dir>/figures/` by default, the README's docs/*.png only
    with DSPO_UPDATE_SHIPPED=1, and the documented commands do not name docs/ without it."""
    docs = REPO / "docs"
    sweep = tmp_path / "sweep"
    assert analysis.figure_paths(sweep, env={}) == {
        "DSPO_FIGURE": sweep / "figures" / "sweep.png",
        "DSPO_ABLATION_FIGURE": sweep / "figures" / "ablation.png",
    }
    env = {"DSPO_FIGURE": str(tmp_path / "a.png"), "DSPO_ABLATION_FIGURE": ""}  # "" = do not save
    assert analysis.figure_paths(sweep, env=env) == {"DSPO_FIGURE": tmp_path / "a.png", "DSPO_ABLATION_FIGURE": None}
    with pytest.raises(ValueError, match="DSPO_UPDATE_SHIPPED=1"):
        analysis.figure_paths(sweep, env={"DSPO_FIGURE": str(docs / "sweep.png")})
    shipped = analysis.figure_paths(sweep, env={"DSPO_UPDATE_SHIPPED": "1"})
    assert shipped == {"DSPO_FIGURE": docs / "sweep.png", "DSPO_ABLATION_FIGURE": docs / "ablation.png"}
    guide = (docs / "notebook.md").read_text()
    commands = [line for line in guide.splitlines() if "DSPO_RUN_DIR=" in line]
    assert commands and not any("docs/" in line and "DSPO_UPDATE_SHIPPED=1" not in line for line in commands)
    assert "figure_paths(RUN_DIR)" in NOTEBOOK.read_text()
