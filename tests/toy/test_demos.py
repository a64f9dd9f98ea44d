"""Scripted demonstrations: format accepted by the agent's parser, correct play reads observations, imperfect share."""

from __future__ import annotations

import random

import pytest

from dspo.agent.parsing import QWEN_CLOSE, parse_call
from dspo.env import SearchTool
from dspo.env.rewards import extract_answer, subem_reward
from dspo.search.bm25 import BM25Index
from dspo.toy.deep import deep_demo_questions
from dspo.toy.demos import CORRECT, IMPERFECT_KINDS, ScriptedPolicy, choose_kind, evidence, make_script
from dspo.toy.world import ToyWorldConfig, generate_world
from dspo.types import Passage, QAItem

SEARCH = {"search": SearchTool(retriever=None, max_query_chars=200)}


def parse_qwen_tool_call(text: str):
    """The agent's parser, as the agent calls it for a turn that stopped at </tool_call>."""
    return parse_call(text, SEARCH, "qwen", QWEN_CLOSE)


CFG = ToyWorldConfig(seed=1, num_people=120, num_companies=60, num_rivers=12, num_distractors=40)
CFG.num_train, CFG.num_val, CFG.num_test, CFG.num_demo = 100, 40, 40, 80


@pytest.fixture(scope="module")
def setup():
    ents, corpus, qa, _, _ = generate_world(CFG)
    passages = []
    for row in corpus:
        title, text = row["contents"].split("\n", 1)
        passages.append(Passage(row["id"], title.strip('"'), text))
    index = BM25Index.build(passages, show_progress=False)
    items = [QAItem(q["id"], q["question"], q["golden_answers"], metadata=q["metadata"]) for q in qa["train"]]
    return ents, index, items


def _play(
    policy: ScriptedPolicy, index: BM25Index, max_turns: int = 4, observations: list[str] | None = None
) -> tuple[list[str], str | None]:
    """A minimal agent loop: parse each turn with the agent's parser, search, format `Doc i (Title: t) text`."""
    turns, observations = [], [] if observations is None else observations
    for _ in range(max_turns):
        text = policy(observations)
        turns.append(text)
        if "<answer>" in text:
            return turns, extract_answer(text)
        call = parse_qwen_tool_call(text)
        if not call.ok:
            observations.append(call.error)
            continue
        hits = index.search(call.arguments["query_list"], 3)[0]
        observations.append("\n".join(f"Doc {i + 1} (Title: {p.title}) {p.text}" for i, p in enumerate(hits)))
    return turns, None


def test_correct_policy_answers_every_question(setup) -> None:
    ents, index, items = setup
    for item in items:
        policy = ScriptedPolicy(item, ents, CORRECT, random.Random(0))
        turns, answer = _play(policy, index)
        assert subem_reward(answer, item.golden_answers) == 1.0, (item.question, turns)
        assert len(turns) == item.metadata["hops"] + 1  # one search per hop, then the answer
        for t in turns[:-1]:
            assert t.startswith("<think>") and t.endswith("</tool_call>")
            assert parse_qwen_tool_call(t).ok


def _thought(turn: str) -> str:
    return turn.split("<think>", 1)[1].split("</think>", 1)[0]


def test_turns_after_a_passage_quote_its_evidence_then_plan_the_rest(setup) -> None:
    ents, index, items = setup
    item = next(i for i in items if i.metadata["hops"] == 2 and i.metadata["relations"] == ["born_in", "country"])
    person, city = item.metadata["chain"]
    observations: list[str] = []
    turns, answer = _play(ScriptedPolicy(item, ents, CORRECT, random.Random(0)), index, observations=observations)
    assert _thought(turns[0]) == f"I need the country of the birthplace of {person}."
    quote, plan = _thought(turns[1]).split(". ", 1)
    assert quote + "." in observations[0] and person in quote and city in quote  # a sentence of the passage
    assert plan == f"I need the country of {city}."
    final = _thought(turns[2])
    assert final in observations[1] and final.startswith(city) and final.endswith(f"{answer}.")
    assert answer == item.golden_answers[0]
    early, _ = _play(ScriptedPolicy(item, ents, "wrong_hop", random.Random(0)), index)
    assert early[1] == f"<think>{quote}.</think>\n<answer>{city}</answer>"


def test_evidence_is_the_sentence_naming_entity_and_value() -> None:
    observation = (
        "Doc 1 (Title: Kozan Tower) The Kozan Tower stands in Lipindale. It was designed by Jatun Soma.\n"
        "Doc 2 (Title: Jatun Soma) Jatun Soma works as a poet. Jatun Soma was born in Lipindale.\n"
        "(You have one turn left: give your final answer now.)"
    )
    assert evidence(observation, "Jatun Soma", "Lipindale") == "Jatun Soma was born in Lipindale."
    assert evidence(observation, "Lipindale", "Sarunstan") is None  # named in different passages: not stated


def test_evidence_is_cut_after_the_later_of_the_two_names() -> None:
    company = "Doc 1 (Title: Kadrou Corp) Kadrou Corp was founded by Moudrork Ledrend in 1998. It employs 7,690 people."
    assert evidence(company, "Kadrou Corp", "Moudrork Ledrend") == "Kadrou Corp was founded by Moudrork Ledrend."
    assert evidence(company, "Moudrork Ledrend", "Kadrou Corp") == "Kadrou Corp was founded by Moudrork Ledrend."
    born = "Doc 1 (Title: Jatun Soma) Born in Lipindale, Jatun Soma grew up there."
    assert evidence(born, "Jatun Soma", "Lipindale") == "Born in Lipindale, Jatun Soma."
    assert evidence("Born in Lipindale, Jatun Soma grew up there.", "Lipindale", "Jatun Soma") == (
        "Born in Lipindale, Jatun Soma."
    )


def test_distractor_quotes_the_evidence_with_the_wrong_name(setup) -> None:
    ents, index, items = setup
    item = next(i for i in items if i.metadata["hops"] == 1 and i.metadata["relations"] == ["country"])
    turns, answer = _play(ScriptedPolicy(item, ents, "distractor", random.Random(3)), index)
    passage = "\n".join(p.text for p in index.search([item.metadata["chain"][0]], 3)[0])
    quoted = evidence(passage, item.metadata["chain"][0], item.golden_answers[0])
    assert answer != item.golden_answers[0] and _thought(turns[-1]) == quoted.replace(item.golden_answers[0], answer)


def test_correct_policy_does_not_answer_unread_facts(setup) -> None:
    ents, _, items = setup
    item = next(i for i in items if i.metadata["hops"] == 2)
    policy = ScriptedPolicy(item, ents, CORRECT, random.Random(0))
    answer = extract_answer(policy(["Doc 1 (Title: Unrelated) nothing useful here"]))
    assert answer is not None and subem_reward(answer, item.golden_answers) == 0.0


@pytest.mark.parametrize("kind", IMPERFECT_KINDS)
def test_imperfect_kinds_fail_and_stay_parseable(setup, kind) -> None:
    ents, index, items = setup
    failures = 0
    for item in items[:60]:
        turns, answer = _play(ScriptedPolicy(item, ents, kind, random.Random(1)), index)
        assert answer is not None, turns
        failures += subem_reward(answer, item.golden_answers) == 0.0
        if kind == "malformed":
            assert not parse_qwen_tool_call(turns[0]).ok
    assert failures >= 55


def test_imperfect_share(setup) -> None:
    ents, _, items = setup
    rng = random.Random(0)
    kinds = [make_script(items[i % len(items)], ents, rng, 0.3).kind for i in range(2000)]
    share = sum(k != CORRECT for k in kinds) / len(kinds)
    assert 0.26 < share < 0.34 and set(kinds) == {CORRECT, *IMPERFECT_KINDS}
    assert all(choose_kind(rng, 0.0, 1) == CORRECT for _ in range(50))
    with pytest.raises(ValueError, match="imperfect_share"):
        choose_kind(rng, 1.5, 1)


def test_early_stop_share_applies_to_multi_hop_questions_only() -> None:
    rng = random.Random(0)
    one_hop = [choose_kind(rng, 0.0, 1, early_stop_share=0.6) for _ in range(1000)]
    two_hop = [choose_kind(rng, 0.0, 2, early_stop_share=0.6) for _ in range(1000)]
    assert set(one_hop) == {CORRECT}
    assert set(two_hop) == {CORRECT, "wrong_hop"} and 0.55 < two_hop.count("wrong_hop") / 1000 < 0.65
    with pytest.raises(ValueError, match="early_stop_share"):
        choose_kind(rng, 0.0, 2, early_stop_share=-0.1)


def test_imperfect_kinds_are_drawn_from_the_configured_ones() -> None:
    rng = random.Random(0)
    one_hop = [choose_kind(rng, 1.0, 1) for _ in range(600)]
    assert set(one_hop) == set(IMPERFECT_KINDS) - {"wrong_hop"}  # a 1-hop question has no hop to stop before
    assert min(one_hop.count(kind) for kind in set(one_hop)) > 150  # uniform over the three
    two_hop = [choose_kind(rng, 1.0, 2, imperfect_kinds=["no_search", "wrong_hop"]) for _ in range(400)]
    assert set(two_hop) == {"no_search", "wrong_hop"}
    assert {choose_kind(rng, 1.0, 1, imperfect_kinds=["wrong_hop"]) for _ in range(50)} == {CORRECT}
    assert {choose_kind(rng, 1.0, 2, imperfect_kinds=[]) for _ in range(50)} == {CORRECT}
    with pytest.raises(ValueError, match=r"imperfect_kinds: unknown \['misread'\]"):
        choose_kind(rng, 0.5, 1, imperfect_kinds=["misread"])


def test_make_script_passes_the_imperfect_kinds_on(setup) -> None:
    ents, _, items = setup
    rng = random.Random(0)
    kinds = {make_script(item, ents, rng, 1.0, imperfect_kinds=["malformed"]).kind for item in items}
    assert kinds == {"malformed"}


def test_hop2_imperfect_share_replaces_the_share_for_multi_hop_questions(setup) -> None:
    ents, _, items = setup
    rng = random.Random(0)
    by_hops = {1: set(), 2: set()}
    for item in items:
        by_hops[item.metadata["hops"]].add(make_script(item, ents, rng, 1.0, hop2_imperfect_share=0.0).kind)
    assert by_hops[2] == {CORRECT} and CORRECT not in by_hops[1]
    shares = {1: [], 2: []}
    for item in items * 10:
        shares[item.metadata["hops"]].append(make_script(item, ents, rng, 0.0, hop2_imperfect_share=0.5).kind)
    assert set(shares[1]) == {CORRECT} and 0.4 < sum(k != CORRECT for k in shares[2]) / len(shares[2]) < 0.6


def test_deep_chains_take_one_search_per_hop_and_early_stops_fall_short_of_the_chain(setup) -> None:
    """3-/4-hop demonstrations (dspo.toy.deep, the demo split's chains): the correct policy searches once per hop, a
    landmark's designer included (its sentence says "It"); `wrong_hop` answers the entity reached after 1 to hops-1
    searches, each count drawn somewhere."""
    ents, index, _ = setup
    _, corpus, _, _, _ = generate_world(CFG)
    rows = deep_demo_questions(ents, corpus, CFG.seed)
    items = [QAItem(q["id"], q["question"], q["golden_answers"], metadata=q["metadata"]) for q in rows]
    assert {i.metadata["hops"] for i in items} == {3, 4} and any(i.metadata["entity_type"] == "landmark" for i in items)
    stops = {3: set(), 4: set()}
    for n, item in enumerate(items):
        hops, chain = item.metadata["hops"], [*item.metadata["chain"], *item.golden_answers]
        turns, answer = _play(ScriptedPolicy(item, ents, CORRECT, random.Random(n)), index, max_turns=6)
        assert answer == item.golden_answers[0] and len(turns) == hops + 1, turns
        turns, answer = _play(ScriptedPolicy(item, ents, "wrong_hop", random.Random(n)), index, max_turns=6)
        searches = len(turns) - 1
        assert 1 <= searches < hops and answer == chain[searches], turns
        stops[hops].add(searches)
    assert stops == {3: {1, 2}, 4: {1, 2, 3}}


def test_evidence_of_a_landmarks_designer_quotes_the_sentence_before_it() -> None:
    observation = "Doc 1 (Title: Kozan Tower) The Kozan Tower stands in Lipindale. It was designed by Jatun Soma."
    assert evidence(observation, "Kozan Tower", "Jatun Soma") == (
        "The Kozan Tower stands in Lipindale. It was designed by Jatun Soma."
    )
    assert evidence(observation, "Kozan Tower", "Sarunstan") is None
