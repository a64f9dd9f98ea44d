"""The worked examples of docs/extending.md, each run as the guide runs it.

The example modules live in docs/examples (a user's own folder, not a package): tests put that folder on sys.path (or
PYTHONPATH for `dspo-train` subprocesses) exactly as the guide's commands do, and undo what the imports registered.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from dspo.algorithms import ADVANTAGES, OBJECTIVES, policy_loss
from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.rollout_correction import RolloutCorrectionConfig
from dspo.train import CONF_DIR, build, import_modules

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
SEARCHPATH = "hydra.searchpath=[file://docs/examples/conf]"  # as in the guide: relative to the repository root


@pytest.fixture
def examples(monkeypatch):
    """docs/examples on sys.path, cwd at the repository root; afterwards its modules and registrations are gone."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(REPO)
    yield
    for name in ("my_objective", "my_advantage", "my_world", "my_retriever", "my_tool", "my_reward", "my_agent"):
        sys.modules.pop(name, None)
    OBJECTIVES.pop("seq_cispo")
    ADVANTAGES.pop("batch_std")


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=["output_dir=/tmp/dspo_extending", *overrides])


# ------------------------------------------------------------------------------------ 1. a new objective
def test_objective_registers_from_imports_with_its_setting_hand_computed_value_and_gradient(examples):
    with pytest.raises(ValueError, match="algorithm.loss: unknown objective 'seq_cispo'"):
        AlgorithmConfig(loss="seq_cispo")  # not known before the import
    import_modules(["my_objective"])  # what dspo-train does with imports=[my_objective]
    record = OBJECTIVES["seq_cispo"]
    assert record.normalizer_unit == record.ratio_level == "sequence"
    assert (record.settings.clip_low, record.settings.clip_high, record.settings.lower_bound) == (0.2, 0.28, False)
    config = AlgorithmConfig(loss="seq_cispo", loss_kwargs={"clip_high": 0.2, "lower_bound": True})  # its own setting
    assert config.objective_settings.lower_bound and config.objective_settings.clip_high == 0.2
    with pytest.raises(ValueError, match="algorithm.loss_kwargs.cap: objective 'seq_cispo' has no setting 'cap'"):
        AlgorithmConfig(loss="seq_cispo", loss_kwargs={"cap": 1.2})
    with pytest.raises(ValueError, match="rollout_correction.mode"):
        AlgorithmConfig(loss="seq_cispo", rollout_correction=RolloutCorrectionConfig("token_tis"))

    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    rows = [[-0.8, -1.6, -math.inf], [-0.6, math.nan, -math.inf], [-1.5, -math.inf, 0.0]]
    new = torch.tensor(rows, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 1.0], dtype=torch.float64)
    # s_1 = exp(0.3) = 1.3499 -> weight 1.2 (capped); s_2 = exp(-0.1) = 0.904837 (inside); s_3 = exp(-0.5) = 0.606531:
    # 0.8 with the lower bound, itself without. J = Σ_i w_i Â_i mean_t logπ / 3; loss = -J; d loss / d logπ_it =
    # -w_i Â_i / (3 |y_i|) on trained tokens
    s2, s3 = math.exp(-0.1), math.exp(-0.5)
    for lower_bound, w3, clipfrac in ((True, 0.8, 2 / 3), (False, s3, 1 / 3)):
        logprobs = new.clone().requires_grad_(True)
        settings = {"clip_low": 0.2, "clip_high": 0.2, "lower_bound": lower_bound}
        loss, stats = policy_loss("seq_cispo", logprobs, old, advantages, mask, settings)
        assert loss.item() == pytest.approx(-(1.2 * -1.2 + s2 * 0.3 + w3 * -1.5) / 3, abs=1e-12)
        loss.backward()
        expected = torch.tensor([[-0.2, -0.2, 0.0], [s2 / 6, 0.0, 0.0], [-w3 / 3, 0.0, 0.0]], dtype=torch.float64)
        torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=0)
        assert stats["clipfrac"].item() == pytest.approx(clipfrac)
        assert stats["ratio_max"].item() == pytest.approx(math.exp(0.3))


def test_import_and_registration_errors_name_what_to_fix():
    from dspo.algorithms import register_objective

    with pytest.raises(ImportError, match="imports: module 'no_such_module_xyz' failed to import"):
        import_modules(["no_such_module_xyz"])
    with pytest.raises(TypeError, match=r"imports must be a list of module names, e\.g\. imports=\[my_objective\]"):
        import_modules("my_objective")
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        register_objective("mine", ratio_level="chunk")
    assert "mine" not in OBJECTIVES


# ------------------------------------------------------------------------ 2. a new advantage estimator
def test_advantage_estimator_registers_from_imports_with_a_hand_computed_value(examples):
    with pytest.raises(ValueError, match="algorithm.advantage: unknown advantage estimator 'batch_std'"):
        AlgorithmConfig(advantage="batch_std")
    import_modules(["my_advantage"])
    config = AlgorithmConfig(advantage="batch_std")
    # centred rewards [[.75, -.25, -.25, -.25], [.5, .5, -.5, -.5]]: mean 0, Σ squares 1.75, unbiased var 1.75/7 = 0.25
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [1.0, 1.0, -1.0, -1.0]])
    torch.testing.assert_close(config.advantages(rewards), expected, atol=1e-5, rtol=0)
    eps = AlgorithmConfig(advantage="batch_std", advantage_kwargs={"eps": 0.5})  # its setting: 0.5 / (0.5 + 0.5)
    assert eps.advantages(rewards)[1, 0].item() == pytest.approx(0.5)


# ---------------------------------------------------------------------- 3. a new QA dataset and a new world
def test_new_dataset_composes_into_the_datamodule(examples):
    cfg = compose_train("data.train_files=[docs/examples/data/my_qa.jsonl]")  # the guide's override
    datamodule = instantiate(cfg.data)
    assert datamodule.train_files == ["docs/examples/data/my_qa.jsonl"]
    assert list(datamodule.val_files) == ["toy_1hop", "toy_2hop"]  # validation stays on the toy world
    datamodule.val_files = {}  # those files belong to prepare=toyworld's cache; only the train stream is tested here
    datamodule.setup("fit")
    items = datamodule.sampler.items
    assert len(items) == 8 and {item.benchmark for item in items} == {"my_qa"}
    assert items[0].golden_answers == ["Hilaxdale"] and items[6].golden_answers == ["Judros Sobrun", "Sobrun"]


def test_new_world_prepares_and_builds_with_its_retriever(examples, tmp_path):
    cfg = compose_train(SEARCHPATH, "prepare=ships", "data=ships", "retriever=ships", f"paths.cache={tmp_path}")
    assert list(cfg.prepare) == ["toyworld", "ships"]
    root = instantiate(cfg.prepare.ships)  # the world's own step (toyworld's builds the policy, cached elsewhere)
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "corpus.jsonl",
        "manifest.json",
        "test.jsonl",
        "train.jsonl",
        "val.jsonl",
    ]
    stamp = (Path(root) / "corpus.jsonl").stat().st_mtime_ns
    assert instantiate(cfg.prepare.ships) == root and (Path(root) / "corpus.jsonl").stat().st_mtime_ns == stamp
    objects = build(cfg)  # datamodule, module, callbacks (the BM25 index is built here), trainer; nothing fitted
    datamodule = objects["datamodule"]
    datamodule.setup("fit")
    assert len(datamodule.sampler.items) == 40 and list(datamodule.val_sets) == ["ships"]
    (callback,) = [c for c in objects["callbacks"] if hasattr(c, "producer")]
    # the search tool of env=search, over the ships index
    retriever = callback.producer.spec.env.tools["search"].retriever
    one_hop, two_hop = datamodule.val_sets["ships"][:2]  # even ids ask the home port, odd ids its coast
    ship = one_hop.question.removeprefix("From which port does ").removesuffix(" sail?")
    (hits,) = retriever.search([ship], k=1)
    assert hits[0].title == ship and hits[0].text.endswith(f"sails from {one_hop.golden_answers[0]}.")
    # two searches answer a 2-hop question: the ship's passage names its port, the port's passage its coast
    ship = two_hop.question.removeprefix("On which coast is the home port of ").removesuffix("?")
    (hits,) = retriever.search([ship], k=1)
    port = hits[0].text.split("sails from ")[1].rstrip(".")
    (hits,) = retriever.search([port], k=1)
    assert hits[0].title == port and hits[0].text == f"{port} is a port on the {two_hop.golden_answers[0]}."
    assert two_hop.metadata == {"hops": 2}


# --------------------------------------------------------------------------------- 4. a new retriever
def _corpus(path: Path) -> Path:
    rows = [
        {"id": "0", "title": "Harbor log", "text": "Ana Lys. Ana Lys. Ana Lys waved at the harbor."},
        {"id": "1", "title": "Ana Lys", "text": "Ana Lys was born in Veltra, a town known for its ships and sails."},
        {"id": "2", "title": "Veltra", "text": "Veltra is a town in the south."},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_reranker_is_a_retriever_selected_by_target_and_used_by_the_agent(examples, tmp_path):
    from transformers import AutoTokenizer

    from dspo.agent import AgentConfig
    from dspo.agent.tool_calling import ToolCallingAgent
    from dspo.engines.scripted import ScriptedEngine
    from dspo.env import Environment
    from dspo.process.resources import QWEN_TOKENIZER, data_dir
    from dspo.search import Retriever
    from dspo.types import QAItem

    corpus = _corpus(tmp_path / "corpus.jsonl")
    overrides = [f"retriever.corpus={corpus}", f"retriever.index={tmp_path / 'bm25'}"]
    bm25 = instantiate(compose_train(*overrides).retriever)
    cfg = compose_train("retriever._target_=my_retriever.TitleMatchReranker", "+retriever.candidates=3", *overrides)
    reranker = instantiate(cfg.retriever)
    assert isinstance(reranker, Retriever) and type(reranker).__name__ == "TitleMatchReranker"
    query = "Ana Lys"  # the search the agent issues below
    assert [p.id for p in bm25.search([query], 1)[0]] == ["0"]  # BM25 alone: the passage that repeats the name
    assert [p.id for p in reranker.search([query], 2)[0]] == ["1", "0"]  # the passage about Ana Lys first

    tokenizer = AutoTokenizer.from_pretrained(str(data_dir().joinpath(*QWEN_TOKENIZER)))
    turns = ["<search> Ana Lys </search>", "<answer> Veltra </answer>"]
    config = AgentConfig(tag_format="searchr1", max_turns=3)
    env = Environment.search(reranker, topk=1)
    agent = ToolCallingAgent(ScriptedEngine(tokenizer, [turns]), tokenizer, env, config)
    item = QAItem(id="q", question="Where was Ana Lys born?", golden_answers=["Veltra"])
    (group,) = agent.rollout([item], group_size=1, policy_version=0).groups
    trajectory = group.trajectories[0]
    observation = tokenizer.decode(
        [t for t, m in zip(trajectory.response_ids, trajectory.response_mask, strict=True) if m == 0]
    )
    assert "Ana Lys was born in Veltra" in observation and "waved at the harbor" not in observation
    assert (trajectory.reward, trajectory.num_tool_calls) == (1.0, 1)


# ------------------------------------------------------------------------ 6-7. a new tool and a new reward
def _judge_scripts() -> list[list[str]]:
    return [  # (distinct texts: the scripted engine tells trajectories apart by their history)
        ["<search> capital of France </search>", "<judge> yes </judge>", "<answer> Paris </answer>"],  # right verdict
        ["<judge> yes </judge>", "<answer> Paris </answer>"],  # nothing retrieved yet, says yes: wrong
        ["<search> France </search>", "<judge> maybe </judge>", "<answer> Berlin </answer>"],  # not a verdict
    ]


def test_judge_tool_and_judged_reward_in_the_agent_loop_hand_computed(examples):
    """env=reseek as the guide composes it, run by the real agent loop on scripted turns: the judge tool's calls are
    batched and counted, a bad verdict is the model's fault (counted, explained), the reward's steps by hand."""
    from transformers import AutoTokenizer

    from dspo.agent import AgentConfig
    from dspo.agent.tool_calling import ToolCallingAgent
    from dspo.engines.scripted import ScriptedEngine
    from dspo.env import Environment, SearchTool
    from dspo.process.resources import QWEN_TOKENIZER, data_dir
    from dspo.types import Passage, QAItem

    import_modules(["my_tool", "my_reward"])
    cfg = compose_train(SEARCHPATH, "env=reseek")
    judge, reward = instantiate(cfg.env.tools.judge), instantiate(cfg.env.reward)
    page = Passage(id="1", title="France", text="Paris is the capital of France.")

    class OnePage:
        def search(self, queries, k):
            return [[page] for _ in queries]

    env = Environment({"search": SearchTool(OnePage(), topk=1), "judge": judge}, reward, 0.05, cfg.env.instruction)
    tokenizer = AutoTokenizer.from_pretrained(str(data_dir().joinpath(*QWEN_TOKENIZER)))
    config = AgentConfig(tag_format="searchr1", max_turns=3, max_new_tokens_per_turn=64)
    agent = ToolCallingAgent(ScriptedEngine(tokenizer, _judge_scripts()), tokenizer, env, config)
    item = QAItem(id="q", question="What is the capital of France?", golden_answers=["Paris"])
    result = agent.rollout([item], group_size=3, policy_version=0)
    right, blind, bad = result.groups[0].trajectories
    assert "<information>Noted: answer now." in right.response_text
    assert right.step_rewards == [None, 0.1, None] and right.reward == pytest.approx(1.1)
    assert blind.step_rewards == [-0.1, None] and blind.reward == pytest.approx(0.9)
    assert bad.step_rewards == [None, None, None] and bad.reward == 0.0 and "must be one of" in bad.response_text
    assert right.reward_components == {"subem": 1.0, "judge": 0.1} and blind.reward_components["judge"] == -0.1
    stats = result.stats
    assert stats["calls/judge"] == pytest.approx(2 / 3) and stats["invalid/judge/bad_arguments"] == 1


def test_planning_agent_by_its_hooks_hand_computed(examples, qwen_tokenizer):
    """`rollout.agent._target_=my_agent.PlanningAgent` as the guide composes it, completed by `build_agent` and run on
    scripted turns: the plan turn ends at </plan> and the episode goes on (plan, search, answer: 3 turns, 1 search);
    a first turn that answers at once still ends the episode; the request for a plan is in the prompt."""
    from dspo.agent import build_agent
    from dspo.engines.scripted import ScriptedEngine
    from dspo.env import Environment, SearchTool
    from dspo.types import Passage, QAItem

    import_modules(["my_agent"])
    cfg = compose_train("rollout.agent._target_=my_agent.PlanningAgent")
    page = Passage(id="1", title="France", text="Paris is the capital of France.")

    class OnePage:
        def search(self, queries, k):
            return [[page] for _ in queries]

    plan = "<plan> capital of France </plan>"
    scripts = [[plan, "<search> capital of France </search>", "<answer> Paris </answer>"], ["<answer> Lyon </answer>"]]
    engine = ScriptedEngine(qwen_tokenizer, scripts)
    env = Environment({"search": SearchTool(OnePage(), topk=1)}, instantiate(cfg.env.reward))
    agent = build_agent(instantiate(cfg.rollout.agent), engine=engine, tokenizer=qwen_tokenizer, env=env)
    assert type(agent).__name__ == "PlanningAgent" and agent.config.max_turns == 3  # the toy's limits, as keywords
    item = QAItem(id="q", question="What is the capital of France?", golden_answers=["Paris"])
    planned, direct = agent.rollout([item], group_size=2, policy_version=0).groups[0].trajectories
    assert (planned.num_turns, planned.num_tool_calls, planned.reward, planned.truncated) == (3, 1, 1.0, False)
    assert planned.response_text.startswith(plan) and "Plan noted. Carry it out" in planned.response_text
    assert (direct.num_turns, direct.num_tool_calls, direct.reward) == (1, 0, 0.0)
    assert "First list the searches you will make inside <plan>" in qwen_tokenizer.decode(planned.prompt_ids)


@pytest.mark.slow
def test_cli_run_with_every_example_plugin(run_train, short_default_hf, tmp_path, monkeypatch):
    """The objective, the estimator, the tool, the reward and the agent through `dspo-train 'imports=[...]'`, as the
    guide runs them (an unknown name would be refused when the config is built, so a finished run used all five)."""
    from dspo.sweeps.analysis import find_runs, load_scalars

    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))
    args = [
        "imports=[my_objective,my_advantage,my_tool,my_reward,my_agent]",
        "rollout.agent._target_=my_agent.PlanningAgent",
        SEARCHPATH,
        "env=reseek",
        "algorithm.loss=seq_cispo",
        "+algorithm.loss_kwargs.lower_bound=true",
    ]
    args += ["algorithm.advantage=batch_std", "trainer.max_steps=2", "run_test=false"]
    run_train([*short_default_hf, "data.val_limit=4", *args], tmp_path / "outputs")
    (run,) = find_runs(tmp_path / "outputs" / "train")
    config = (run.dir / ".hydra" / "config.yaml").read_text()
    assert "loss: seq_cispo" in config and "advantage: batch_std" in config and "lower_bound: true" in config
    assert "_target_: my_tool.JudgeTool" in config and "_target_: my_reward.JudgedSubEM" in config
    assert "_target_: my_agent.PlanningAgent" in config
    scalars = load_scalars(run.dir)
    loss = scalars[scalars.tag == "train/loss"]
    assert len(loss) == 2 and loss.value.map(math.isfinite).all()
    assert {"reward/subem", "reward/judge", "rollout/calls/search"} <= set(scalars.tag)
