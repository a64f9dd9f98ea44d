"""Every Hydra config under conf/ composes and resolves; the core objects instantiate from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict, read_write

CONF = Path(__file__).resolve().parents[1] / "conf"
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml"))
TRAIN_GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
# Placeholders (???) that a user must fill for some options; tests fill them with harmless values.
EVAL_ONLY = {("data", "benchmarks"), ("data", "file")}
FILL = {"model.path": "/models/some-model", "retriever.index": "/indexes/wiki18", "data.path": "/data/qa.jsonl"}


def _compose(name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        for key, value in FILL.items():
            parent, leaf = key.rsplit(".", 1)
            node = OmegaConf.select(cfg, parent, throw_on_missing=False)
            if node is not None and leaf in node and OmegaConf.is_missing(node, leaf):
                OmegaConf.update(cfg, key, value)
        with read_write(cfg), open_dict(cfg):
            cfg.pop("hydra")  # its own nodes are read-only; `${hydra:...}` still resolves through HydraConfig
        OmegaConf.resolve(cfg)
        return cfg


def _options(group: str) -> list[tuple[str, str]]:
    """(group, option) for every YAML under conf/<group>; a nested folder is a group of its own (rollout/agent)."""
    return sorted(
        (str(p.parent.relative_to(CONF)), p.stem) for p in (CONF / group).rglob("*.yaml") if p.parent.name != "hydra"
    )


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_config_composes(name, tmp_path):
    extra = [f"output_dir={tmp_path}"] if name == "train" else []
    cfg = _compose(name, extra)
    assert cfg is not None


@pytest.mark.parametrize("group,option", [pair for g in TRAIN_GROUPS if g != "paths" for pair in _options(g)])
def test_every_group_option_composes_into_train(group, option, tmp_path):
    if (group, option) in EVAL_ONLY:  # question sets for dspo-eval, not training DataModules
        cfg = _compose("eval", [f"{group}={option}"])
        assert cfg.data is not None
        return
    cfg = _compose("train", [f"{group}={option}", f"output_dir={tmp_path}"])
    assert OmegaConf.select(cfg, group.replace("/", ".")) is not None or group in ("experiment", "prepare")


def test_experiment_values_win_over_train_yaml(tmp_path):
    """An experiment is composed after train.yaml's own keys: its optimizer settings must reach the module (a
    regression: with `_self_` last, train.yaml's lr 1e-6 silently replaced the toy experiment's lr)."""
    experiment = OmegaConf.load(CONF / "experiment" / "toy.yaml")
    cfg = _compose("train", [f"paths.outputs={tmp_path}"])
    assert cfg.optimizer.lr == experiment.optimizer.lr != OmegaConf.load(CONF / "train.yaml").optimizer.lr
    assert cfg.module.optimizer.lr == experiment.optimizer.lr
    assert cfg.trainer.max_steps == experiment.trainer.max_steps


@pytest.mark.parametrize("algorithm", ["dspo", "gspo", "dapo", "grpo"])
def test_algorithm_configs_instantiate(algorithm, tmp_path):
    cfg = _compose("train", [f"algorithm={algorithm}", f"output_dir={tmp_path}"])
    algo = instantiate(cfg.algorithm)
    assert algo.name == algorithm and algo.loss in ("dspo", "gspo", "dapo", "grpo")
    assert (algo.filter == "mixed_outcome") == (algorithm in ("dspo", "dapo"))
    # the clip range the YAML states is the one the objective's record declares (issue 30: one place)
    assert algo.objective_settings == algo.objective.settings and algo.advantage == "group_norm"


def test_config_mistakes_fail_at_start_with_the_key(tmp_path):
    with pytest.raises(Exception, match="algorithm.group_size"):
        instantiate(_compose("train", ["algorithm.group_size=1", f"output_dir={tmp_path}"]).algorithm)
    with pytest.raises(Exception, match="algorithm.num_minibatches"):
        instantiate(_compose("train", ["algorithm.num_minibatches=3", f"output_dir={tmp_path}"]).algorithm)
    with pytest.raises(Exception, match="no_such_key"):
        _compose("train", ["algorithm.no_such_key=1", f"output_dir={tmp_path}"])


def test_trainer_and_logger_instantiate_on_cpu(tmp_path):
    cfg = _compose("train", [f"output_dir={tmp_path}"])
    from dspo.training.loggers import build_loggers

    trainer = instantiate(cfg.trainer, logger=build_loggers(cfg.logger), callbacks=[])
    assert trainer.max_steps == cfg.trainer.max_steps
    assert Path(trainer.logger.log_dir).parent == tmp_path


def test_fsdp_strategy_composes_and_instantiates(tmp_path):
    from dspo.training.strategies import FSDP2Strategy

    cfg = _compose("train", ["trainer=fsdp", f"output_dir={tmp_path}"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDP2Strategy) and strategy._save_distributed_checkpoint
    assert strategy.process_group_backend is None  # Lightning's default for the device: nccl on GPU, gloo on CPU
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    cpu = _compose("train", ["trainer=fsdp", "trainer.accelerator=cpu", f"output_dir={tmp_path}"])
    assert cpu.trainer.precision == "32-true"  # follows the accelerator, no extra flag


def test_remote_retriever_takes_one_url_or_a_list_of_replicas(tmp_path):
    from dspo.search.client import RemoteRetriever

    urls = ["http://node0:8000/retrieve", "http://node1:8000/retrieve"]
    cfg = _compose("train", ["retriever=remote", f"retriever.url=[{','.join(urls)}]", f"output_dir={tmp_path}"])
    retriever = instantiate(cfg.retriever)
    assert isinstance(retriever, RemoteRetriever) and retriever.urls == tuple(urls) and retriever.cooldown_s == 30.0
    assert instantiate(_compose("train", ["retriever=remote", f"output_dir={tmp_path}"]).retriever).urls == (
        "http://127.0.0.1:8000/retrieve",
    )


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        ([], "seq_tis"),  # k = 0: the geometric mean, DSPO's own unit (numerics only: weights 1 within 1e-6)
        (["rollout.max_staleness=1"], "seq_prod_tis"),  # stale rounds: the truncated importance weight
        (["rollout.max_staleness=2", "algorithm=gspo"], "seq_prod_tis"),
        (["rollout.max_staleness=1", "algorithm=dapo"], "token_tis"),  # token objectives: per-token weights
        (["rollout.max_staleness=1", "algorithm.rollout_correction.mode=seq_tis"], "seq_tis"),  # the user's choice
    ],
)
def test_the_default_rollout_correction_follows_the_staleness(overrides, mode):
    """Issue 38 (1): chosen with bench/correction.py (docs/async.md, "What the objective then estimates")."""
    from dspo.testing import compose_config

    cfg = compose_config("train", ["output_dir=/tmp/run", *overrides])
    assert cfg.algorithm.rollout_correction.mode == mode


def test_lora_is_off_by_default_and_one_override_turns_it_on(tmp_path):
    """`dspo-train model.lora.r=8` (README): Hydra cannot set a key under a null node, so conf/model/ writes the LoRA
    settings with `r: null` (off); `model.lora=null` is off too."""
    from dspo.models.lora import QWEN2_TARGETS, LoraConfig

    assert instantiate(_compose("train", [f"output_dir={tmp_path}"]).model).lora is None
    assert instantiate(_compose("train", ["model.lora=null", f"output_dir={tmp_path}"]).model).lora is None
    cfg = _compose("train", ["model.lora.r=8", f"output_dir={tmp_path}"])
    assert instantiate(cfg.model).lora == LoraConfig(r=8, alpha=32, dropout=0.0, target_modules=list(QWEN2_TARGETS))
    module = instantiate(cfg.module)
    assert module.model_cfg.lora.r == 8 and module.hparams["model"]["lora"]["r"] == 8
    for option in ("qwen2.5-3b-instruct", "qwen2.5-7b-instruct", "local"):
        composed = _compose("train", [f"model={option}", "model.path=/m", "model.lora.r=16", f"output_dir={tmp_path}"])
        assert instantiate(composed.model).lora.scaling == 2.0
    paper = ["experiment=paper_qwen2.5_7b", "model.path=/m", "model.lora.r=16", "optimizer.lr=1e-5"]  # lora.md
    assert instantiate(_compose("train", [*paper, f"output_dir={tmp_path}"]).model).lora.r == 16
    with pytest.raises(Exception, match="model.lora.r must be an integer >= 1"):  # Hydra wraps the ValueError
        instantiate(_compose("train", ["model.lora.r=0", f"output_dir={tmp_path}"]).model)


HYDRA_OPTIONS = sorted((str(p.parent.relative_to(CONF)), p.stem) for p in (CONF / "hydra").rglob("*.yaml"))


@pytest.mark.parametrize("group,option", HYDRA_OPTIONS)
def test_every_hydra_option_composes_and_names_a_plugin_hydra_can_load(group, option, tmp_path):
    """conf/hydra/<group>/*.yaml (the launchers of docs/sweeps.md#a-sweep-on-slurm) compose into train, and their
    `_target_` is a class in Hydra's `hydra_plugins` package (Hydra refuses launchers from anywhere else)."""
    from hydra.core.plugins import Plugins

    assert HYDRA_OPTIONS, "conf/hydra/ holds no option"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"{group}={option}", f"output_dir={tmp_path}"], return_hydra_config=True)
    target = OmegaConf.select(cfg, group.replace("/", "."))._target_
    assert target.startswith("hydra_plugins.") and target in Plugins.instance().class_name_to_class


def test_the_search_experiment_searches_the_documented_keys(tmp_path):
    cfg = _compose("train", ["experiment=search_toy", f"output_dir={tmp_path}"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra = compose("train", overrides=["experiment=search_toy"], return_hydra_config=True).hydra
    assert hydra.sweeper._target_.endswith("OptunaSweeper") and hydra.sweeper.direction == "maximize"
    assert set(hydra.sweeper.params) == {"optimizer.lr", "algorithm.loss_kwargs.clip_high", "algorithm.group_size"}
    assert list(cfg.trial_seeds) == [0, 1] and cfg.sweep_metric == "val/subem_mean" and cfg.toy.topk == 1
