"""`data=reasoning_gym env=reasoning_gym`: items generated offline, and the reward is each task's own scorer (the
rewards dspo computes
equal reasoning-gym's `score_answer` on the same completions, replayed through a fresh dataset)."""

from __future__ import annotations

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from dspo.data.reasoning_gym import ReasoningGymDataModule  # noqa: E402
from dspo.env.reasoning_gym import ReasoningGymReward, generate_items  # noqa: E402
from dspo.env.rewards import EpisodeRecord, extract_answer  # noqa: E402
from dspo.types import QAItem  # noqa: E402

TASKS = {"basic_arithmetic": {}, "chain_sum": {}, "letter_counting": {}, "word_sorting": {}}


def completions(entry: dict) -> list[str]:
    """What a model may write: the right answer, a reformatted one, a wrong one, two answers, none."""
    answer = str(entry["answer"])
    return [
        f"<think>...</think> <answer>{answer}</answer>",
        f"<answer> {answer}.0 </answer>",
        f"<answer>{answer}, {answer}</answer>",
        "<answer>7 apples</answer>",
        f"<answer>wrong</answer> then <answer>{answer}</answer>",
        "I do not know",
    ]


def test_the_reward_is_the_tasks_own_scorer_on_the_same_completions():
    reward = ReasoningGymReward()
    items = generate_items(TASKS, seed=5, size=6, split="train")
    episodes, expected = [], []
    for item in items:
        source = item.metadata["reasoning_gym"]
        fresh = reasoning_gym.create_dataset(source["task"], seed=5, size=6)  # not dspo's cached dataset
        entry = fresh[source["index"]]
        for text in completions(entry):
            answer = extract_answer(text)
            episodes.append(EpisodeRecord(item=item, turns=[], answer=answer))
            expected.append(float(fresh.score_answer(answer, entry)))
    results = reward.score(episodes)
    assert [r.outcome for r in results] == expected
    assert [r.components["reasoning_gym"] for r in results] == expected
    assert 0 < sum(expected) < len(expected)  # the completions are scored both ways


def test_items_are_the_tasks_questions_and_regenerate_the_same():
    first = generate_items({"chain_sum": {"min_terms": 2, "max_terms": 2}}, seed=3, size=4, split="val")
    again = generate_items({"chain_sum": {"min_terms": 2, "max_terms": 2}}, seed=3, size=4, split="val")
    fresh = reasoning_gym.create_dataset("chain_sum", seed=3, size=4, min_terms=2, max_terms=2)
    assert [i.question for i in first] == [i.question for i in again] == [fresh[k]["question"] for k in range(4)]
    assert [i.golden_answers for i in first] == [[str(fresh[k]["answer"])] for k in range(4)]
    assert {i.benchmark for i in first} == {"chain_sum"}
    assert len({i.id for i in first}) == 4


def test_the_datamodule_generates_three_disjoint_seeded_splits():
    module = ReasoningGymDataModule(tasks=["basic_arithmetic", "chain_sum"], size=8, val_size=3, test_size=2, seed=1)
    module.setup(None)
    assert list(module.val_sets) == list(module.test_sets) == ["basic_arithmetic", "chain_sum"]
    assert [len(v) for v in module.val_sets.values()] == [3, 3]
    assert [len(v) for v in module.test_sets.values()] == [2, 2]
    seeds = {
        split: {i.metadata["reasoning_gym"]["seed"] for items in sets.values() for i in items}
        for split, sets in (("val", module.val_sets), ("test", module.test_sets))
    }
    train = [item for _, item in module.sampler.take(16)]
    assert seeds == {"val": {4}, "test": {5}}
    assert {i.metadata["reasoning_gym"]["seed"] for i in train} == {3}
    assert {i.benchmark for i in train} == {"basic_arithmetic", "chain_sum"}


def test_data_configs_reach_the_generator():
    settings = {"chain_sum": {"min_terms": 2, "max_terms": 2}}
    module = ReasoningGymDataModule(tasks=["chain_sum"], configs=settings, size=3)
    module.setup("fit")
    fresh = reasoning_gym.create_dataset("chain_sum", seed=0, size=3, min_terms=2, max_terms=2)
    assert sorted(i.question for _, i in module.sampler.take(3)) == sorted(fresh[k]["question"] for k in range(3))


def test_unknown_tasks_and_foreign_items_fail_naming_the_key():
    with pytest.raises(ValueError, match="data.tasks: \\['no_such_task'\\]"):
        ReasoningGymDataModule(tasks=["no_such_task"])
    with pytest.raises(ValueError, match="data.configs names \\['basic_arithmetic'\\]"):
        ReasoningGymDataModule(tasks=["chain_sum"], configs={"basic_arithmetic": {}})
    with pytest.raises(ValueError, match="data.tasks is empty"):
        ReasoningGymDataModule(tasks=[])
    foreign = QAItem(id="q1", question="Who founded Kozand?", golden_answers=["Bob"])
    with pytest.raises(ValueError, match="data=reasoning_gym"):
        ReasoningGymReward().score([EpisodeRecord(item=foreign, turns=[], answer="Bob")])


def test_an_item_that_does_not_regenerate_fails_instead_of_scoring_another_question():
    (item,) = generate_items({"chain_sum": {}}, seed=0, size=1, split="train")
    item.question = "something else"
    with pytest.raises(ValueError, match="regenerate the items"):
        ReasoningGymReward().score([EpisodeRecord(item=item, turns=[], answer="1")])


@pytest.mark.slow
def test_train_two_steps_on_reasoning_gym_tasks(run_train, short_default_hf, tmp_path):
    """The toy model cannot do arithmetic: the plumbing, the reward and its logs are what is tested. spell_backward pays
    partial credit for a near miss, so rewards differ; no filter, so that two rounds are taken whatever they hold."""
    import math

    from dspo.sweeps.analysis import find_runs, load_scalars

    outputs = tmp_path / "outputs"
    args = [
        *(arg for arg in short_default_hf if not arg.startswith(("data.val_limit", "data.test_limit"))),
        "data=reasoning_gym",
        "env=reasoning_gym",
        "data.tasks=[spell_backward,chain_sum]",
        "data.size=16",
        "data.val_size=4",
        "data.test_size=4",
        "algorithm.filter=none",
        "trainer.max_steps=2",
        "run_name=rg",
    ]
    run_train(args, outputs)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    value = scalars.set_index("tag").value
    tags = set(scalars.tag)
    for tag in ("reward/reasoning_gym", "val/spell_backward/subem", "val/chain_sum/subem", "test/chain_sum/subem"):
        assert tag in tags, f"{tag} missing; logged: {sorted(tags)}"
    rewards = scalars[scalars.tag == "reward/reasoning_gym"].value
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)
    assert all(math.isfinite(g) for g in scalars[scalars.tag == "train/grad_norm"].value)
    assert (value["rollout/tool_calls_mean"] == 0).all()  # no tool: the env has none
