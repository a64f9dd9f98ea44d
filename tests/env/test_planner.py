"""env=planner (AI-SearchPlanner; issue 57, part 3): the planner's reward by hand, the answerer as a tool and as the
hand-off in the real agent loop, the frozen answerer that no weight push reaches, the config, and the refused pair."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines import HFEngine
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool
from dspo.env.answerer import AnswerRequest, EngineAnswerer, ScriptedAnswerer
from dspo.env.planner import SEARCHR1_INSTRUCTION, AskAnswererTool, Costs, PlannerReward
from dspo.env.rewards import EpisodeRecord, TurnRecord
from dspo.env.tools import InvalidCall, ToolResult
from dspo.process.resources import data_dir
from dspo.rollout.link import TrainerLink
from dspo.rollout.sides import InProcessSide
from dspo.testing import compose_config
from dspo.training.combinations import refusals
from dspo.types import Passage, QAItem

BRIKOR = Passage("p0", "Brikor Corp", "Brikor Corp was founded by Tares Brumin in 1998.")
TARES = Passage("p1", "Tares Brumin", "Tares Brumin was born in Lipindale.")
JETHAM = Passage("toy181", "Jetham Jibex", "Jetham Jibex was born in Jarosville. Jetham Jibex works as a judge.")
PAGES = [BRIKOR, TARES, JETHAM]
HOP1 = QAItem("toy-1", "Who founded Brikor Corp?", ["Tares Brumin"], metadata={"chain": ["Brikor Corp"]})
HOP2 = QAItem(
    "toy-2", "In which city was the founder of Brikor Corp born?", ["Lipindale"],
    metadata={"chain": ["Brikor Corp", "Tares Brumin"]},
)  # fmt: skip
SHIPPED = str(data_dir() / "toy_warmstart" / "model")


class TitleRetriever:
    """The page whose title the query names first, then pages sharing a word with it (a BM25 stand-in)."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        out = []
        for query in queries:
            words = set(query.lower().split())
            score = [(p.title.lower() in query.lower(), len(words & set(p.text.lower().split())), p) for p in PAGES]
            out.append([p for t, s, p in sorted(score, key=lambda x: (-x[0], -x[1])) if t or s][:k])
        return out


def searched(query: str, *passages: Passage, error: str | None = None, queries: int = 1) -> TurnRecord:
    text = "".join(f"Doc {i + 1} (Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))
    call = ("search", {"query_list": [query] * queries})
    return TurnRecord(f"<search> {query} </search>", call, result=ToolResult(text, list(passages), error=error))


# ------------------------------------------------------------------------------------------ the reward by hand
def test_the_planners_reward_is_the_answerers_outcome_plus_plan_quality_minus_costs_hand_computed():
    reward = PlannerReward(
        ScriptedAnswerer(), plan_weight=0.2, cost={"search": 0.1, "answerer": 0.3, "unfinished": 0.25}
    )
    both = EpisodeRecord(  # two searches find both gold pages; the planner's own answer is wrong
        HOP2,
        [searched("Brikor Corp", BRIKOR), searched("Tares Brumin", TARES), TurnRecord("<answer> X </answer>")],
        "X",
    )
    ask = TurnRecord("<ask> where? </ask>", ("ask", {"question": "where?"}), result=ToolResult("The answerer says: -"))
    half = EpisodeRecord(  # 3 queries in a call + a failed search: 4 searches; one ask; half the gold pages
        HOP2,
        [searched("Brikor", BRIKOR, queries=3), ask, searched("Tares", TARES, error="down"), TurnRecord("...")],
        "Lipindale",
        truncated=True,  # out of turns: an unfinished plan
    )
    first, second = reward.score([both, half])
    # 1 + 0.2 x 1 - (0.1 x 2 searches + 0.3 x 1 call: the hand-off) = 0.7
    assert first.outcome == 1.0 and first.answer == "Lipindale" and first.total == pytest.approx(0.7)
    assert first.components == pytest.approx(
        {"answerer_subem": 1.0, "planner_subem": 0.0, "answer_found": 1.0, "searches": 2.0, "answerer_calls": 1.0,
         "unfinished": 0.0, "gold_pages": 1.0, "plan_quality": 1.0, "cost": 0.5}
    )  # fmt: skip
    # the failed search found nothing: the answerer has Brikor Corp's page only, no answer; unfinished:
    # 0 + 0.2 x 0.5 - (0.4 + 0.6 + 0.25)
    assert second.outcome == 0.0 and second.answer == "" and second.total == pytest.approx(-1.15)
    assert second.components == pytest.approx(
        {"answerer_subem": 0.0, "planner_subem": 1.0, "answer_found": 0.0, "searches": 4.0, "answerer_calls": 2.0,
         "unfinished": 1.0, "gold_pages": 0.5, "plan_quality": 0.5, "cost": 1.25}
    )  # fmt: skip
    free = {"search": 0.0, "answerer": 0.0, "unfinished": 0.0}
    by_answer = PlannerReward(ScriptedAnswerer(), plan_weight=0.2, cost=free, plan_quality="answer_found")
    no_gold = EpisodeRecord(QAItem("nq-1", "Who?", ["Tares Brumin"]), [searched("Brikor", BRIKOR)], None)
    paid, unnamed = by_answer.score([half, no_gold])
    assert paid.total == pytest.approx(0.0) and paid.components["plan_quality"] == 0.0  # no cost: 0 + 0.2 x 0
    assert unnamed.total == pytest.approx(1.2) and "gold_pages" not in unnamed.components  # no chain: not logged


# ------------------------------------------------------------------------------------------ in the agent loop
def test_the_answerer_answers_asks_from_what_was_found_and_answers_for_the_planner(qwen_tokenizer):
    scripts = [
        ["<search> Brikor Corp </search>", "<ask> who founded it? </ask>", "<answer> Wrong Person </answer>"],
        ["<ask> who founded Brikor Corp? </ask>", "<answer> Tares Brumin </answer>"],  # asks before any search
    ]
    answerer = ScriptedAnswerer()
    tools = {"search": SearchTool(TitleRetriever(), topk=1), "ask": AskAnswererTool(answerer)}
    env = Environment(tools, PlannerReward(answerer), instruction=SEARCHR1_INSTRUCTION)
    agent = ToolCallingAgent(ScriptedEngine(qwen_tokenizer, scripts), qwen_tokenizer, env, tag_format="searchr1")
    rollout = agent.rollout([HOP1], 2, 0)
    searcher, asker = rollout.groups[0].trajectories
    assert "The answerer says: Tares Brumin" in searcher.response_text
    assert "The answerer cannot answer from what you found." in asker.response_text
    # the answer scored (and validated, tested) is the answerer's; the planner's own is only logged
    assert searcher.answer == "Tares Brumin" and searcher.outcome == 1.0
    assert searcher.reward_components["planner_subem"] == 0.0
    assert asker.answer is None and asker.outcome == 0.0 and asker.reward_components["planner_subem"] == 1.0
    assert searcher.reward == pytest.approx(1.0 + 0.1 * 1.0 - 0.05 * 1 - 0.05 * 2)  # the config's default weights
    assert rollout.stats["reward/answerer_calls"] == 2.0 and rollout.stats["tool/ask/answered"] == 0.5
    with pytest.raises(InvalidCall):
        AskAnswererTool(answerer, max_question_chars=5).prepare({"question": "a longer question"})


class RecordingEngine:
    """A built engine for the answerer: answers every prompt and keeps the token ids it was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.prompts = tokenizer, []
        self._answers = ScriptedEngine(tokenizer, lambda prompt, turn, index: "<answer> Tares Brumin </answer>")

    def generate(self, prompts, sampling):
        self.prompts += [list(prompt) for prompt in prompts]
        return self._answers.generate(prompts, sampling)


class KeptEpisodes(PlannerReward):
    """The planner's reward, keeping the episodes it scored."""

    def score(self, episodes):
        self.episodes = list(episodes)
        return super().score(episodes)


class EveryPage:
    """Every page for every query: results of ~70 tokens."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [PAGES[:k] for _ in queries]


@pytest.mark.parametrize("max_obs_tokens", [5, 12, 31, 400])
def test_the_answerer_reads_each_result_cut_to_the_tokens_the_planner_saw(qwen_tokenizer, max_obs_tokens):
    """The answerer's transcript after its first prompt is the planner's context after its own, token id for token
    id, up to the planner's final turn: each result cut where the agent loop cut it (results of ~70 tokens, cut to 5,
    12 and 31; 400 cuts nothing), the "one turn left" note after the second result cut with it."""
    scripts = [["<search> Brikor Corp </search>", "<search> Tares Brumin </search>", "<answer> X </answer>"]] * 2
    recorder = RecordingEngine(qwen_tokenizer)
    answerer = EngineAnswerer(engine=recorder, max_turns=3, max_obs_tokens=max_obs_tokens)
    reward = KeptEpisodes(answerer)
    env = Environment({"search": SearchTool(EveryPage(), topk=3)}, reward)
    planner = ToolCallingAgent(
        ScriptedEngine(qwen_tokenizer, scripts), qwen_tokenizer, env, tag_format="searchr1", max_turns=3,
        max_obs_tokens=max_obs_tokens,
    )  # fmt: skip
    trajectories = planner.rollout([HOP2], 2, 0).groups[0].trajectories
    first = answerer.prompt_ids(qwen_tokenizer, AnswerRequest(HOP2.question))
    assert len(recorder.prompts) == 2  # the hand-off, one per episode
    uncut = EngineAnswerer(engine=RecordingEngine(qwen_tokenizer), max_turns=3)  # what the answerer read before
    for trajectory, prompt, episode in zip(trajectories, recorder.prompts, reward.episodes):
        assert trajectory.num_tool_calls == 2 and trajectory.answer == "Tares Brumin"
        final_start = trajectory.turn_spans[-1][0]
        assert prompt[: len(first)] == first
        assert prompt[len(first) :] == trajectory.response_ids[:final_start]
        whole = uncut.prompt_ids(qwen_tokenizer, AnswerRequest(HOP2.question, episode.turns))
        sizes = [len(qwen_tokenizer.encode(t.result.text)) for t in episode.turns if t.result is not None]
        assert len(sizes) == 2 and 31 < min(sizes) <= max(sizes) < 400
        if max_obs_tokens < min(sizes):
            assert len(whole) > len(prompt)  # uncut, the answerer read past what the planner saw
        else:
            assert whole == prompt


# ------------------------------------------------------------------------------------------ frozen
def test_the_answerer_is_loaded_once_frozen_and_no_weight_push_reaches_it():
    """The policy's engine and the answerer hold the same warm start; a push of trained weights (what InProcessSide does
    after each optimizer step) changes the policy's engine only: the answerer's parameters and answers stay."""
    policy = HFEngine(model_path=SHIPPED)
    answerer, asker = (EngineAnswerer(SHIPPED, partial(HFEngine), max_turns=3) for _ in range(2))
    tools = {"search": SearchTool(TitleRetriever(), topk=1), "ask": AskAnswererTool(asker)}
    env = Environment(tools, PlannerReward(answerer))
    side = InProcessSide(policy, ToolCallingAgent(policy, None, env, tag_format="searchr1", max_turns=3), None)
    think = "<think>I need the birthplace of Jetham Jibex.</think>\n<search> Jetham Jibex </search>"
    request = AnswerRequest("Where was Jetham Jibex born?", [searched("Jetham Jibex", JETHAM)], key="k")
    request.turns[0].text = think
    before = answerer.answer([request])
    assert before == ["Jarosville"]  # the shipped warm start reads the answer from the planner's transcript
    assert answerer._engine() is asker._engine()  # the tool's and the reward's answerer: one model in the process
    frozen = answerer._engine().engine.model
    snapshot = {name: p.detach().clone() for name, p in frozen.named_parameters()}
    trained = [(name, p.detach() + 0.25) for name, p in policy.model.named_parameters()]
    side.push(TrainerLink(weights=lambda: trained, weights_version=lambda: 1), SimpleNamespace(engine_version=0))
    assert policy.version == 1 and all(torch.equal(p, dict(trained)[n]) for n, p in policy.model.named_parameters())
    assert all(torch.equal(p, snapshot[name]) for name, p in frozen.named_parameters())
    assert not any(p.requires_grad for p in frozen.parameters())
    assert answerer.answer([request]) == before
    with pytest.raises(RuntimeError, match="env.reward.answerer: the answerer is frozen"):
        answerer._engine().push_weights(trained, 2)


# ------------------------------------------------------------------------------------------ config
def test_env_planner_composes_with_the_toy_default_and_its_weights_are_keys():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose_config("train", ["env=planner", "output_dir=/tmp/x"])
    assert not refusals(cfg)
    reward = instantiate(cfg.env.reward)
    assert isinstance(reward, PlannerReward) and reward.plan_weight == 0.1 and reward.cost == Costs(0.05, 0.05)
    answerer = reward.answerer
    assert isinstance(answerer, EngineAnswerer) and answerer.model_path == SHIPPED and answerer.factory.func is HFEngine
    assert (answerer.tag_format, answerer.max_turns, answerer.instruction) == ("searchr1", 3, None)
    assert answerer.max_obs_tokens == cfg.rollout.agent.max_obs_tokens == 160  # results cut where the planner's were
    assert cfg.env.instruction is None  # the toy's default instruction: the one the warm start knows
    ask = OmegaConf.to_container(cfg.env.tools.ask.answerer, resolve=True)
    assert ask == OmegaConf.to_container(cfg.env.reward.answerer, resolve=True)  # the same answerer
    assert isinstance(instantiate(cfg.env.tools.ask), AskAnswererTool)
    swept = compose_config("train", ["env=planner", "env.reward.cost.search=0.3", "rollout.agent.max_turns=4"])
    built = instantiate(swept.env.reward)
    assert built.cost == Costs(0.3, 0.05) and built.answerer.max_turns == 4
    cut = compose_config("train", ["env=planner", "rollout.agent.max_obs_tokens=40"])
    assert instantiate(cut.env.reward).answerer.max_obs_tokens == 40


def test_mistakes_name_the_key():
    with pytest.raises(ValueError, match=r"env\.reward\.cost\.serch: not a cost"):
        Costs.of({"serch": 0.1})
    with pytest.raises(ValueError, match=r"env\.reward\.cost\.answerer=-1.0"):
        Costs.of({"answerer": -1})
    with pytest.raises(ValueError, match=r"env\.reward\.plan_quality='recall'"):
        PlannerReward(ScriptedAnswerer(), plan_quality="recall")
    with pytest.raises(ValueError, match=r"env\.reward\.plan_weight=-0.1"):
        PlannerReward(ScriptedAnswerer(), plan_weight=-0.1)
    with pytest.raises(ValueError, match=r"env\.reward\.credit=turn"):
        PlannerReward(ScriptedAnswerer(), credit="turn")
    with pytest.raises(ValueError, match=r"env\.reward\.answerer\.model_path"):
        EngineAnswerer()
    with pytest.raises(ValueError, match=r"env\.reward\.answerer\.max_obs_tokens=0"):
        EngineAnswerer(SHIPPED, max_obs_tokens=0)


def test_turn_credit_with_the_planner_is_refused_when_composed_naming_both_keys():
    cfg = compose_config("train", ["env=planner", "algorithm=dapo", "env.reward.credit=turn", "output_dir=/tmp/x"])
    (message,) = refusals(cfg)
    assert message.startswith("env.reward.credit=turn with env.reward._target_=dspo.env.planner.PlannerReward")
    assert not refusals(compose_config("train", ["env=search", "algorithm=dapo", "env.reward.credit=turn"]))
