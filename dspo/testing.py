"""Stand-ins for the rollout side, so `DSPOModule` + `RolloutCallback` train on CPU in seconds in tests.

`build_toy_lm` writes a random Qwen2 model with a tiny vocabulary (no tokenizer, no download); `ScriptedAgent` returns
token-level groups whose content depends only on the prompt and the call's seed (so a resumed run can be compared
with an uninterrupted one); `RecordingEngine` keeps every weight push. `attach` wires them into a callback in place of
the vLLM engine, the search agent and the tokenizer.
"""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dspo.agent.protocol import AgentRollout
from dspo.rollout.sampler import RoundSampler
from dspo.types import QAItem, RolloutGroup, Trajectory

TOY_VOCAB = 48

# Each Hydra console script and its primary config (conf/<name>.yaml): what the docs and --help tests compose.
HYDRA_COMMANDS = {
    "dspo-train": "train",
    "dspo-eval": "eval",
    "dspo-index": "index",
    "dspo-serve": "serve",
    "dspo-rollout": "rollout_cli",
    "dspo-prepare-data": "prepare_data",
    "dspo-plan": "train",
}


def build_toy_lm(output_dir: str, vocab_size: int = TOY_VOCAB, seed: int = 0) -> str:
    """A 1-layer Qwen2 causal LM (hidden 16) saved with `save_pretrained`; float32, dropout-free."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(output_dir)
    return output_dir


@dataclass
class ScriptedAgent:
    """An `Agent` for tests: G trajectories per prompt, at least one reward 1 and one reward 0 each.

    Response lengths, environment-token positions (mask 0) and rewards come from `random.Random(f"{id}/{seed}")`.
    """

    vocab_size: int = TOY_VOCAB
    calls: list[tuple[list[str], int, int | None]] = field(default_factory=list)  # (prompt ids, version, seed)
    stats: dict[str, float] = field(default_factory=lambda: {"tool_calls_mean": 0.0, "invalid_calls": 0.0})
    env: Any = None

    def rollout(
        self, items: list[QAItem], group_size: int, policy_version: int, greedy: bool = False, seed: int | None = None
    ) -> AgentRollout:
        self.calls.append(([item.id for item in items], policy_version, seed))
        return AgentRollout([self._group(item, group_size, policy_version, seed) for item in items], dict(self.stats))

    def _group(self, item: QAItem, group_size: int, policy_version: int, seed: int | None) -> RolloutGroup:
        rng = random.Random(f"{item.id}/{seed}")
        prompt = [rng.randrange(3, self.vocab_size) for _ in range(rng.randint(2, 4))]
        rewards = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(group_size - 2)]
        rng.shuffle(rewards)
        trajectories = []
        for reward in rewards:
            response = [rng.randrange(3, self.vocab_size) for _ in range(rng.randint(2, 7))]
            mask = [0 if 0 < i < len(response) - 1 and rng.random() < 0.25 else 1 for i in range(len(response))]
            logprobs = [-1.0 if m else 0.0 for m in mask]
            trajectories.append(Trajectory(prompt, response, mask, logprobs, reward, policy_version=policy_version))
        return RolloutGroup(item=item, trajectories=trajectories)


@dataclass
class SplittingAgent(ScriptedAgent):
    """`ScriptedAgent` whose episodes are each trained as `pieces` samples (`Trajectory.segments`), as a compacted
    context or an endpoint's prefix break makes them: the response is cut into `pieces` consecutive parts, each earlier
    part a `Segment` whose context the next part's prompt extends."""

    pieces: int = 2

    def _group(self, item: QAItem, group_size: int, policy_version: int, seed: int | None) -> RolloutGroup:
        group = super()._group(item, group_size, policy_version, seed)
        group.trajectories = [split_episode(t, self.pieces) for t in group.trajectories]
        return group


def split_episode(trajectory: Trajectory, pieces: int) -> Trajectory:
    """`trajectory` as `pieces` samples (fewer when its response is shorter): the same tokens, cut in order."""
    from dspo.types import Segment

    response, n = trajectory.response_ids, len(trajectory.response_ids)
    cuts = sorted({round(n * k / pieces) for k in range(1, pieces)} - {0, n})
    bounds = [0, *cuts, n]
    segments, prompt = [], list(trajectory.prompt_ids)
    for start, end in zip(bounds[:-2], bounds[1:-1]):
        part = slice(start, end)
        segments.append(
            Segment(prompt, response[part], trajectory.response_mask[part], trajectory.engine_logprobs[part])
        )
        prompt = prompt + response[part]
    last = slice(bounds[-2], n)
    trajectory.prompt_ids, trajectory.response_ids = prompt, response[last]
    trajectory.response_mask = trajectory.response_mask[last]
    trajectory.engine_logprobs = trajectory.engine_logprobs[last]
    trajectory.segments = segments
    return trajectory


@dataclass
class RecordingEngine:
    """Holds a version tag and a copy of every pushed weight set, as the real engines' `push_weights` would load."""

    version: int = 0
    pushes: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)

    def push_weights(self, named_tensors, version: int) -> None:
        self.pushes.append((version, {name: tensor.detach().clone() for name, tensor in named_tensors}))
        self.version = version


def compose_config(name: str, overrides: list[str]):
    """The composed Hydra config `conf/<name>.yaml` with `overrides`, as the commands compose it (not resolved)."""
    from hydra import compose, initialize_config_dir

    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def worker_spec(max_staleness: int = 1, **changes: Any):
    """A `WorkerSpec` of the stand-ins (recording engine, scripted agent; G = 4, B = 2): an engine process that costs
    a Python start-up, not an engine's. `changes` replace any field."""
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.rollout.spec import WorkerSpec

    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=3)
    fields = dict(engine=recording_engine, env=None, algorithm=algorithm, model=ModelConfig(path="unused"))
    fields.update(agent=scripted_agent, tokenizer=StandInTokenizer())
    return WorkerSpec(**{**fields, **changes}, seed=0, max_staleness=max_staleness)


def recording_engine(model_path: str | None = None) -> RecordingEngine:
    """A `RecordingEngine` built as the real engines are (`engine(model_path=...)`): the engine process's stand-in."""
    return RecordingEngine()


def scripted_agent(engine=None, tokenizer=None, env=None) -> ScriptedAgent:
    """An agent constructor for tests (`rollout.agent`, completed by `build_agent`): the scripted agent."""
    return ScriptedAgent()


@dataclass
class WeightsEchoAgent(ScriptedAgent):
    """`ScriptedAgent` whose trajectories tell, in `response_text` (JSON), what its `RecordingEngine` holds: the
    version and number of loads, and each tensor's sum (the engine process's weights, seen from the trainer)."""

    engine: Any = None

    def _group(self, item: QAItem, group_size: int, policy_version: int, seed: int | None) -> RolloutGroup:
        group = super()._group(item, group_size, policy_version, seed)
        version, weights = self.engine.pushes[-1] if self.engine.pushes else (None, {})
        sums = {name: float(tensor.sum()) for name, tensor in weights.items()}
        text = json.dumps({"version": version, "loads": len(self.engine.pushes), "sums": sums})
        for trajectory in group.trajectories:
            trajectory.response_text = text
        return group


def weights_echo_agent(engine=None, tokenizer=None, env=None) -> WeightsEchoAgent:
    """An agent constructor for tests: a `WeightsEchoAgent` on the engine it is given."""
    return WeightsEchoAgent(engine=engine)


@dataclass
class SlowAgent(ScriptedAgent):
    """`ScriptedAgent` whose every call after the first takes `delay_s` (a long round, generated by a process that
    may be orphaned meanwhile)."""

    delay_s: float = 60.0

    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        if self.calls:
            import time

            time.sleep(self.delay_s)
        return super().rollout(items, group_size, policy_version, greedy, seed)


def slow_agent(engine=None, tokenizer=None, env=None) -> SlowAgent:
    return SlowAgent()


@dataclass
class BulkyAgent(ScriptedAgent):
    """`ScriptedAgent` whose trajectories carry `extra_tokens` more tokens each (rounds that fill a pipe)."""

    extra_tokens: int = 20_000

    def _group(self, item, group_size, policy_version, seed):
        group = super()._group(item, group_size, policy_version, seed)
        for t in group.trajectories:
            t.response_ids = t.response_ids + [3] * self.extra_tokens
            t.response_mask = t.response_mask + [1] * self.extra_tokens
            t.engine_logprobs = t.engine_logprobs + [-1.0] * self.extra_tokens
        return group


def bulky_agent(engine=None, tokenizer=None, env=None) -> BulkyAgent:
    return BulkyAgent()


def _idle() -> None:
    """A child process's work: nothing (module level: a spawned child must find it by name)."""


def parent_agent(engine=None, tokenizer=None, env=None) -> ScriptedAgent:
    """An agent constructor (`rollout.agent`) that starts and joins a child process first, as vLLM's multiprocess
    executor or a tool's process pool would in the engine process (a daemonic process may not have children)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_idle)
    child.start()
    child.join()
    return ScriptedAgent(stats={"tool_calls_mean": 0.0, "invalid_calls": 0.0, "child_exit": child.exitcode})


@dataclass
class PidEnvironment:
    """An environment stand-in that records in `path` the process that built it (`dspo.env.spec.EnvironmentSpec`)."""

    path: str
    credit: str = "trajectory"

    def __post_init__(self) -> None:
        import os

        with open(self.path, "a") as handle:
            handle.write(f"{os.getpid()}\n")

    def on_progress(self, step: int, total_steps: int | None) -> None:
        pass


def report_environment_agent(engine=None, tokenizer=None, env=None):
    """An agent constructor (`rollout.agent`) that fails on purpose, reporting the engine process's
    CUDA_VISIBLE_DEVICES."""
    import os

    raise RuntimeError(f"engine process sees CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")


def recording_logger():
    """A Lightning logger that keeps every `log_metrics` call as (step, metrics) in `.records` (nothing written)."""
    from lightning.pytorch.loggers.logger import Logger

    class RecordingLogger(Logger):
        name, version = "recording", 0

        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[int | None, dict]] = []

        def log_metrics(self, metrics, step=None) -> None:
            self.records.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs) -> None:
            pass

    return RecordingLogger()


def toy_items(n: int = 40) -> list[QAItem]:
    return [QAItem(id=str(i), question=f"q{i}", golden_answers=["a"]) for i in range(n)]


class StandInTokenizer:
    """What the trainer and the scripted agents need of a tokenizer (the toy model has none)."""

    pad_token_id = 0

    def save_pretrained(self, path: str) -> None:  # the toy model has no tokenizer files to export
        return None


def attach(callback, agent: ScriptedAgent, engine: RecordingEngine, world_size: int = 1) -> None:
    """Put the stand-ins into an `RolloutCallback` before `trainer.fit` (its `setup` then builds nothing)."""
    from dspo.rollout.sides import InProcessSide

    callback.producer.tokenizer = StandInTokenizer()
    callback.producer.attach(InProcessSide(engine, agent, RoundSampler(agent, callback.algo, 0, world_size)))


def toy_run(
    model_dir: str,
    root: str,
    max_steps: int,
    module_cls: Any = None,
    lr: float = 1e-2,
    seed: int = 0,
    warmup_steps: int = 0,
    callbacks: tuple = (),
    max_staleness: int = 0,
    lora: Any = None,
    **algorithm: Any,
) -> SimpleNamespace:
    """Module, callback (with the stand-ins attached), datamodule and a CPU trainer for `max_steps` optimizer steps.

    `algorithm` overrides `AlgorithmConfig` fields (defaults: G=4, B=2, M=1, micro-batches of 3 sequences, wide clip,
    no rollout correction); `callbacks` go to the trainer after the environment callback. With `max_staleness` >= 1
    the scripted agent and a recording engine run in the engine process (`run.agent`, `run.engine` are then None).
    `lora` is `model.lora` (e.g. `{"r": 4}`).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Checkpoint

    from dspo.algorithms.config import AlgorithmConfig
    from dspo.callbacks.rollout_callback import RolloutCallback
    from dspo.data.datamodule import PromptSampler, RolloutDataModule
    from dspo.models import ModelConfig
    from dspo.training.module import DSPOModule, OptimizerConfig

    defaults = {"group_size": 4, "batch_groups": 2, "micro_batch_size": 3}
    defaults["loss_kwargs"] = {"clip_low": 0.2, "clip_high": 0.3}
    if "rollout_correction" in AlgorithmConfig.__dataclass_fields__:  # scripted engine logprobs are not the model's
        defaults["rollout_correction"] = {"mode": "none"}
    algo = AlgorithmConfig(**{**defaults, **algorithm})
    model = ModelConfig(path=model_dir, lora=lora)
    module = (module_cls or DSPOModule)(
        model, algo, OptimizerConfig(lr=lr, weight_decay=0.0, warmup_steps=warmup_steps)
    )
    if max_staleness:
        callback = RolloutCallback(
            recording_engine, None, None, algo, model, seed=seed, sample_every_n_rounds=0, max_staleness=max_staleness
        )
        callback.producer.spec.agent, callback.producer.tokenizer = scripted_agent, StandInTokenizer()
        callback.producer.spec.tokenizer = StandInTokenizer()
        agent = engine = None
    else:
        callback = RolloutCallback(None, None, None, algo, model, seed=seed, sample_every_n_rounds=0)
        agent, engine = ScriptedAgent(), RecordingEngine()
        attach(callback, agent, engine)
    datamodule = RolloutDataModule(train_files=["scripted"], seed=seed)
    datamodule.sampler = PromptSampler(toy_items(), seed=seed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback, *callbacks],
        logger=False,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    return SimpleNamespace(
        module=module, callback=callback, agent=agent, engine=engine, datamodule=datamodule, trainer=trainer
    )


EXIT_DEADLINE_S = 30  # from a command's last line to its exit (measured: ~1-2 s; issue 38 point 10 hung for ever)


def run_to_exit(
    cmd: list[str], env: dict, timeout: float, finished: str, cwd: str | Path | None = None, finishes: int = 1
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` under two deadlines: `timeout` for the whole command, and
    EXIT_DEADLINE_S from the `finishes`-th stdout line containing `finished` (a multirun prints one per run) to the
    process's exit: a finished run that never exits, e.g. an executor joined before it was shut down, fails here
    instead of holding a job until walltime."""
    import threading
    import time

    process = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
    finished_at: list[float] = []

    def read(name: str) -> None:
        for line in getattr(process, name):
            lines[name].append(line)
            if name == "stdout" and finished in line:
                finished_at.append(time.time())

    readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in lines]
    for reader in readers:
        reader.start()
    started = time.time()
    while process.poll() is None:
        late = len(finished_at) >= finishes and time.time() - finished_at[finishes - 1] > EXIT_DEADLINE_S
        if late or time.time() - started > timeout:
            process.kill()
            process.wait()
            what = f"did not exit within {EXIT_DEADLINE_S} s of '{finished}'" if late else f"ran over {timeout} s"
            raise AssertionError(f"{' '.join(cmd)} {what}\n{''.join(lines['stderr'])[-4000:]}")
        time.sleep(0.2)
    for reader in readers:
        reader.join(10)
    return subprocess.CompletedProcess(cmd, process.returncode, "".join(lines["stdout"]), "".join(lines["stderr"]))


def send_reply(sender: Any, message: Any, point: str | None = None) -> None:
    """An engine process's reply and nothing else (`dspo.rollout.channel.ReplySender.put`), for the channel tests."""
    sender.put(message, point=point)


def midsize_agent(engine=None, tokenizer=None, env=None) -> BulkyAgent:
    """`BulkyAgent` with rounds of a few hundred kB: more than a pipe holds, still trainable on the toy model."""
    return BulkyAgent(extra_tokens=1_500)


def child_agent(engine=None, tokenizer=None, env=None) -> SlowAgent:
    """A tool's child process as a process pool or vLLM's executor would start one (a long sleep; its pid written to
    `$DSPO_TEST_CHILD_PID`), then slow rounds: an engine process killed mid-round leaves it behind unless swept."""
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["DSPO_TEST_CHILD_PID"], "w") as handle:
        handle.write(str(child.pid))
    return SlowAgent(delay_s=60.0)


def within(seconds: float, call):
    """`call()` in a thread; fails if it has not returned or raised within `seconds` (it would have hung)."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a hang"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def scripted_proposals(parts) -> list[QAItem]:
    """A `Role.derive` for tests: one solver item per proposer episode rewarded 1 (a "valid proposal"), its question
    naming its origin (`dspo.agent.roles.derived_item`)."""
    from dspo.agent.roles import derived_item

    (proposer,) = [part for part in parts if part.role == "proposer"]
    return [
        derived_item(proposer, g, e, f"{group.item.question} -> proposal {e}", ["a"])
        for g, group in enumerate(proposer.groups)
        for e, trajectory in enumerate(group.trajectories)
        if trajectory.reward == 1.0
    ]


def two_role_agent(engine=None, tokenizer=None, env=None):
    """An agent constructor for tests (`rollout.agent`): a `RoleAgent` whose proposer and solver are scripted agents,
    the solver's items built from the proposer's valid episodes, the proposer paid the solver's failure rate."""
    from dspo.agent.roles import FailureRateReward, Role, RoleAgent

    roles = [Role("proposer", scripted_agent), Role("solver", scripted_agent, derive=scripted_proposals)]
    return RoleAgent(engine, tokenizer, env, roles, settle=FailureRateReward())


def signal_at_step(step: int, name: str = "SIGUSR1"):
    """A Lightning callback that sends this process the signal `name` at the end of optimizer step `step`, as a
    scheduler preempting the run would (`+callbacks.preempt._target_=dspo.testing.signal_at_step
    +callbacks.preempt.step=N`; tests/test_preempt_every_step.py)."""
    import os
    import signal

    import lightning.pytorch as pl

    class SignalAtStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == step:
                os.kill(os.getpid(), getattr(signal, name))

    return SignalAtStep()


def examples(n: int) -> int:
    """A property test's hypothesis examples: `n`, or a tenth of it (at least 10) under `DSPO_MUTATION=1`, where
    `make mutation` runs the test once per mutant (docs/testing.md#mutation-score)."""
    import os

    return max(10, n // 10) if os.environ.get("DSPO_MUTATION") == "1" else n
