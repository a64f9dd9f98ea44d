"""env=simulated (ZeroSearch): the noise curriculum, its reproducible draws, the scripted and the engine simulators, the
tool in the real agent loop, and the config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dspo.agent import AgentConfig
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SubEMReward
from dspo.env.simulated import (
    EngineSimulator,
    NoiseCurriculum,
    ScriptedSimulator,
    SimulatedQuery,
    SimulatedSearchTool,
    parse_document,
)
from dspo.env.tools import CallContext
from dspo.process.resources import QWEN_TOKENIZER, data_dir
from dspo.types import Generation, Passage, QAItem

REPO = Path(__file__).resolve().parents[2]
BRIKOR = QAItem(id="toy-train-1", question="Who founded Brikor Corp?", golden_answers=["Tares Brumin"])
PAGES = [
    Passage("p0", "Brikor Corp", "Brikor Corp was founded by Tares Brumin in 1998."),
    Passage("p1", "Zelto Corp", "Zelto Corp was founded by Mira Kosh in 2001."),
    Passage("p2", "Vandu Corp", "Vandu Corp was founded by Tares Brumin in 2004."),  # states the answer
    Passage("p3", "Brikor Tower", "The Brikor Tower stands in Lipindale. It was designed by Tares Brumin."),
    Passage("p4", "Tares Brumin", "Tares Brumin was born in Lipindale."),
    Passage("p5", "Gorn Corp", "Gorn Corp was founded by Ula Trent in 1990."),
]


class RankedRetriever:
    """Pages ranked by the number of query words they contain (a BM25 stand-in); records each batch."""

    def __init__(self, pages: list[Passage]) -> None:
        self.pages, self.calls = pages, []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append((list(queries), k))
        out = []
        for query in queries:
            words = set(query.lower().split())
            scored = [(len(words & set(f"{p.title} {p.text}".lower().split())), i, p) for i, p in enumerate(self.pages)]
            out.append([p for s, i, p in sorted(scored, key=lambda t: (-t[0], t[1])) if s > 0][:k])
        return out


class Recorder:
    """A simulator that returns nothing and keeps what it was asked."""

    def __init__(self) -> None:
        self.batches: list[list[SimulatedQuery]] = []

    def simulate(self, queries: list[SimulatedQuery]) -> list[list[Passage]]:
        self.batches.append(queries)
        return [[] for _ in queries]


class CountingEngine(ScriptedEngine):
    def __init__(self, tokenizer, script) -> None:
        super().__init__(tokenizer, script)
        self.prompts: list[list[str]] = []

    def generate(self, prompts, sampling) -> list[Generation]:
        self.prompts.append([self.tokenizer.decode(p) for p in prompts])
        return super().generate(prompts, sampling)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(data_dir().joinpath(*QWEN_TOKENIZER)))


# draws() of 2 episodes x 2 queries x k = 3 at p = 0.5 (seed 0, step 5 of 10)
PINNED = [[True, True, False], [False, False, False], [True, False, True], [False, True, True]]


def draws(seed: int = 0, step: int = 5, total: int = 10, episodes: int = 40, **kw) -> list[list[bool]]:
    """Noise flags of one batch: `episodes` calls of two queries each, k = 3."""
    recorder = Recorder()
    tool = SimulatedSearchTool(recorder, topk=3, seed=seed, **{"noise_start": 0.2, "noise_end": 0.8, **kw})
    tool.on_progress(step, total)
    calls = [{"query_list": ["Brikor Corp", "Tares Brumin"]} for _ in range(episodes)]
    tool.run(calls, [CallContext(BRIKOR, turn=1, episode_index=i) for i in range(episodes)])
    return [q.noisy for q in recorder.batches[0]]


# ------------------------------------------------------------------------------------------ curriculum and draws
def test_curriculum_at_start_middle_end_and_without_a_horizon():
    linear = NoiseCurriculum(0.1, 0.5)
    assert [linear.at(s, 100) for s in (0, 50, 100, 150)] == pytest.approx([0.1, 0.3, 0.5, 0.5])
    assert linear.at(30, None) == linear.at(30, -1) == 0.1  # eval / unbounded run: no horizon, the start
    exponential = NoiseCurriculum(0.0, 0.9, "exponential", base=10.0)
    assert exponential.at(50, 100) == pytest.approx(0.9 * (10**0.5 - 1) / 9)  # ZeroSearch: slow first, then fast
    assert [exponential.at(s, 100) for s in (0, 100)] == pytest.approx([0.0, 0.9])


@pytest.mark.parametrize(
    "kwargs,key",
    [({"noise_end": 1.5}, "noise_end"), ({"schedule": "cosine"}, "schedule"), ({"schedule_base": 1.0}, "base")],
)
def test_curriculum_mistakes_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"env\.tools\.search\.\w*{key}"):
        SimulatedSearchTool(Recorder(), **{"schedule": "exponential", **kwargs})


def test_draws_are_seeded_by_seed_step_and_call_and_follow_the_probability():
    first = draws()
    assert draws() == first  # a second tool, same seed and step: the same documents are noisy
    assert draws(seed=1) != first and draws(step=6) != first
    flags = [f for query in first for f in query]
    assert abs(sum(flags) / len(flags) - 0.5) < 0.07  # p at step 5 of 10: 0.2 + 0.6 / 2
    assert len({tuple(q) for q in first}) > 4  # episodes and queries draw apart
    assert not any(any(q) for q in draws(step=0, noise_start=0.0)) and all(
        all(q) for q in draws(noise_end=1.0, step=10)
    )


def test_draws_do_not_depend_on_the_process_or_global_rngs():
    """A resumed run is a new process (another hash seed, fresh global RNGs): it must draw the same, so the draws are
    pinned here (a change to them is a change to every run's documents, like a new seed)."""
    random.seed(1), torch.manual_seed(1)
    pinned = draws(episodes=2)
    random.seed(2), torch.manual_seed(2)
    assert draws(episodes=2) == pinned == PINNED


# ------------------------------------------------------------------------------------------ scripted simulator
def scripted_query(noisy: list[bool], key: str = "k") -> SimulatedQuery:
    return SimulatedQuery("Brikor Corp", noisy, key, BRIKOR.question, BRIKOR.golden_answers)


def test_scripted_simulator_gold_at_noise_0_distractor_without_the_answer_at_noise_1():
    retriever = RankedRetriever(PAGES)
    simulator = ScriptedSimulator(retriever, distractor_pool=5)
    assert simulator.simulate([scripted_query([False])]) == [[PAGES[0]]]
    noisy = [simulator.simulate([scripted_query([True], key=f"k{i}")])[0] for i in range(20)]
    # never the gold page; never a page stating the answer (Vandu Corp, Brikor Tower): another company
    assert {doc.title for docs in noisy for doc in docs} == {"Zelto Corp", "Gorn Corp"}
    # k = 2: Zelto Corp ranks 2nd, a useful page; the only clean page below is Gorn Corp, the other slot stays empty
    assert simulator.simulate([scripted_query([True, True])]) == [[PAGES[5]]]
    assert simulator.simulate([scripted_query([False, True])]) == [[PAGES[0], PAGES[5]]]
    assert retriever.calls[0] == (["Brikor Corp"], 6)  # one search per batch, k + distractor_pool deep


def test_scripted_simulator_leaves_a_noisy_slot_empty_rather_than_state_the_answer():
    only_answer_pages = RankedRetriever([PAGES[0], PAGES[2], PAGES[3]])
    assert ScriptedSimulator(only_answer_pages).simulate([scripted_query([True])]) == [[]]
    unknown_answer = SimulatedQuery("Brikor Corp", [True], "k", "Who?", [])
    assert ScriptedSimulator(only_answer_pages).simulate([unknown_answer])[0][0] in PAGES[2:4]


# ------------------------------------------------------------------------------------------ engine simulator
@pytest.mark.parametrize(
    "text,expected",
    [
        ("Title: Brikor Corp\nText: Founded in 1998.<|im_end|>", ("Brikor Corp", "Founded in 1998.")),
        ("(Title: Brikor Corp) Founded in 1998.", ("Brikor Corp", "Founded in 1998.")),
        ("Doc 1: Title: Brikor\nA company.\nIn Lipindale.", ("Brikor", "A company. In Lipindale.")),
        ("## Brikor Corp\nA company.", ("Brikor Corp", "A company.")),
        ("just one line of text", ("q", "just one line of text")),
        ("<|endoftext|>", ("q", "")),
        ("Title:\n\n", ("q", "")),
        ("))((**", ("q", "))((**")),
    ],
)
def test_parse_document_never_raises(text, expected):
    assert parse_document(text, "q") == expected


def doc_script(prompt: str, turn: int, index: int) -> str:
    kind = "Noisy" if "must not contain the answer" in prompt else "Useful"
    return f"Title: {kind} page {index}\nText about the query."


def test_engine_simulator_one_batched_generate_prompts_as_drawn_and_parses(qwen_tokenizer):
    engine = CountingEngine(qwen_tokenizer, doc_script)
    simulator = EngineSimulator(engine=engine, max_new_tokens=32)
    queries = [scripted_query([False, True], "a"), SimulatedQuery("Zelto Corp", [True, False], "b", "Who?", [])]
    docs = simulator.simulate(queries)
    (prompts,) = engine.prompts  # one generate call, queries x k prompts
    assert len(prompts) == 4 and "<|im_start|>user" in prompts[0]  # the chat template of an instruct model
    assert ["must not contain" in p for p in prompts] == [False, True, True, False]
    assert "Query: Brikor Corp" in prompts[0] and "Its answer is: Tares Brumin" in prompts[0]
    assert "Query: Zelto Corp" in prompts[2] and "Its answer is: unknown" in prompts[2]
    assert [[d.title for d in ds] for ds in docs] == [
        ["Useful page 0", "Noisy page 1"],
        ["Noisy page 2", "Useful page 3"],
    ]
    assert docs[0][0].text == "Text about the query." and docs[0][1].id.startswith("simulated/noisy/")


def test_engine_simulator_prompt_mistakes_and_missing_model_name_the_key():
    with pytest.raises(ValueError, match=r"simulator\.noisy_prompt.*\{query\}"):
        EngineSimulator(model_path="m", noisy_prompt="no query here")
    with pytest.raises(ValueError, match=r"simulator\.useful_prompt"):
        EngineSimulator(model_path="m", useful_prompt="{query} {title}")
    with pytest.raises(ValueError, match=r"simulator\.model_path"):
        EngineSimulator()


def test_engine_simulator_with_a_real_hf_engine_built_on_first_use(tmp_path):
    """The real engine path on a tiny random Qwen2 (CPU): built lazily, one generate, never raises on its text."""
    from dspo.engines import HFEngine
    from dspo.toy.model import build_tiny_model

    tokenizer_dir = str(data_dir().joinpath(*QWEN_TOKENIZER))
    model_dir = build_tiny_model(
        tokenizer_dir, str(tmp_path / "sim"), hidden_size=64, num_layers=1, intermediate_size=64
    )
    built = []

    def factory(model_path: str) -> HFEngine:
        built.append(HFEngine(model_path=model_path))
        return built[-1]

    simulator = EngineSimulator(model_path=model_dir, engine=factory, max_new_tokens=6, seed=3)
    assert built == []  # not at config time
    queries = [scripted_query([False, True], "a"), scripted_query([True, True], "b")]
    first = simulator.simulate(queries)
    assert len(built) == 1 and [len(ds) for ds in first] == [2, 2]
    assert all(isinstance(d.text, str) and d.title for ds in first for d in ds)
    assert simulator.simulate(queries) == first and len(built) == 1  # seeded sampling, the same engine


# ------------------------------------------------------------------------------------------ in the agent
def searchr1_agent(tokenizer, tool, scripts) -> ToolCallingAgent:
    env = Environment({"search": tool}, SubEMReward())
    config = AgentConfig(tag_format="searchr1", max_turns=3, max_new_tokens_per_turn=64)
    return ToolCallingAgent(ScriptedEngine(tokenizer, scripts), tokenizer, env, config)


SEARCH = "<think>I need the founder.</think>\n<search> Brikor Corp </search>"
ANSWER = "<think>Found it.</think>\n<answer> Tares Brumin </answer>"


@pytest.mark.parametrize("noise_end", [0.0, 1.0])
def test_tool_in_the_real_agent_loop(qwen_tokenizer, noise_end):
    retriever = RankedRetriever(PAGES)
    tool = SimulatedSearchTool(ScriptedSimulator(retriever), topk=1, noise_end=noise_end, seed=0)
    agent = searchr1_agent(qwen_tokenizer, tool, [[SEARCH, ANSWER]] * 2)
    agent.env.on_progress(10, 10)  # the trainer's call: the end of training, noise_end
    result = agent.rollout([BRIKOR], group_size=2, policy_version=0)
    trajectories = result.groups[0].trajectories
    assert [t.num_tool_calls for t in trajectories] == [1, 1] and len(retriever.calls) == 1  # one batch per turn
    text = trajectories[0].response_text
    assert "<information>Doc 1 (Title: " in text
    assert ("(Title: Brikor Corp)" in text) == (noise_end == 0.0)
    assert result.stats["tool/search/noise_probability"] == noise_end  # the agent averages them per round
    assert result.stats["tool/search/noisy_share"] == noise_end  # k = 1


def test_tool_results_carry_the_noise_as_metrics():
    tool = SimulatedSearchTool(ScriptedSimulator(RankedRetriever(PAGES)), topk=1, noise_end=1.0)
    tool.on_progress(4, 4)
    calls = [{"query_list": ["Brikor Corp", "Gorn Corp"]}, {"query_list": ["Zelto Corp"]}]
    first, second = tool.run(calls, [CallContext(BRIKOR, 0, 0), CallContext(BRIKOR, 0, 1)])
    assert first.error is None and first.text.startswith('Results for "Brikor Corp":\nDoc 1 (Title: ')
    assert len(first.passages) == 2 and len(second.passages) == 1
    assert first.metrics == {"noise_probability": 1.0, "noisy_share": 1.0}  # 2 of 2 documents noisy
    assert second.metrics == {"noise_probability": 1.0, "noisy_share": 1.0}


def test_engine_simulator_in_the_agent_one_generate_per_turn(qwen_tokenizer):
    sim_engine = CountingEngine(qwen_tokenizer, doc_script)
    tool = SimulatedSearchTool(EngineSimulator(engine=sim_engine), topk=2, noise_start=0.5, noise_end=0.5)
    agent = searchr1_agent(qwen_tokenizer, tool, [[SEARCH, SEARCH, ANSWER]] * 3)
    trajectories = agent.rollout([BRIKOR], group_size=3, policy_version=0).groups[0].trajectories
    assert [len(batch) for batch in sim_engine.prompts] == [6, 6]  # 2 turns with searches: 3 episodes x k = 2 each
    assert "Title: Useful page" in trajectories[0].response_text or "Title: Noisy page" in trajectories[0].response_text
    flags = ["must not contain" in p for batch in sim_engine.prompts for p in batch]
    assert 0 < sum(flags) < len(flags)


# ------------------------------------------------------------------------------------------ config
def test_env_simulated_composes_and_instantiates(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    GlobalHydra.instance().clear()
    engine_block = (
        "+env.tools.search.simulator={_target_:dspo.env.simulated.EngineSimulator,model_path:/models/sim,"
        "engine:{_target_:dspo.engines.VLLMEngine,_partial_:true,gpu_memory_utilization:0.2}}"
    )
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["env=simulated", f"output_dir={tmp_path}", "seed=7"])
        llm = compose(config_name="train", overrides=["env=simulated", "~env.tools.search.simulator", engine_block])
    node = cfg.env.tools.search
    assert (node.topk, node.noise_start, node.noise_end, node.seed) == (1, 0.0, 0.5, 7)  # the toy: topk 1
    retriever = RankedRetriever(PAGES)  # the toy's BM25 index is not built in unit tests
    tool = instantiate(node, simulator=instantiate(node.simulator, retriever=retriever))
    env = instantiate(cfg.env, tools={"search": tool})
    assert isinstance(env.tools["search"], SimulatedSearchTool) and env.tools["search"].retriever is retriever
    simulator = instantiate(llm.env.tools.search.simulator)
    assert isinstance(simulator, EngineSimulator) and simulator.engine is None  # a partial: built on first use
    assert simulator.engine_factory.keywords["gpu_memory_utilization"] == 0.2
