import pytest

from dspo.data.datamodule import PromptSampler, RolloutDataModule, RoundSlot
from dspo.types import QAItem

ITEMS = [QAItem(id=str(i), question=f"q{i}", golden_answers=[str(i)]) for i in range(10)]


def test_sampler_is_seeded_and_covers_an_epoch():
    a, b = PromptSampler(ITEMS, seed=3), PromptSampler(ITEMS, seed=3)
    first = [i for i, _ in a.take(10)]
    assert first == [i for i, _ in b.take(10)]
    assert sorted(first) == list(range(10))
    assert [i for i, _ in a.take(10)] != first  # a new permutation for epoch 2


def test_sampler_resumes_exactly():
    a = PromptSampler(ITEMS, seed=1)
    a.take(7)
    state = a.state_dict()
    expected = [i for i, _ in a.take(9)]
    b = PromptSampler(ITEMS, seed=99)
    b.load_state_dict(state)
    assert [i for i, _ in b.take(9)] == expected


def test_sampler_ranks_are_disjoint():
    r0 = {i for i, _ in PromptSampler(ITEMS, seed=0, rank=0, world_size=2).take(5)}
    r1 = {i for i, _ in PromptSampler(ITEMS, seed=0, rank=1, world_size=2).take(5)}
    assert not r0 & r1 and len(r0 | r1) == 10


def test_train_stream_yields_fresh_slots(tmp_path):
    dm = RolloutDataModule(train_files=["unused.jsonl"])
    iterator = iter(dm.train_dataloader())
    slots = [next(iterator) for _ in range(3)]
    assert all(isinstance(s, RoundSlot) and not s.micro_batches for s in slots)
    assert [s.index for s in slots] == [0, 1, 2]


def test_datamodule_validates_and_saves_sampler_state(tmp_path):
    with pytest.raises(ValueError, match="train_files"):
        RolloutDataModule(train_files=[])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"id": "{i}", "question": "q{i}", "golden_answers": ["x"]}}\n' for i in range(6)))
    dm = RolloutDataModule(train_files=[str(path)], val_files={"toy": str(path)}, val_limit=4, seed=5)
    dm.setup("fit")
    dm.sampler.take(4)
    state = dm.state_dict()
    dm2 = RolloutDataModule(train_files=[str(path)], seed=5)
    dm2.load_state_dict(state)
    dm2.setup("fit")
    assert dm2.sampler.take(2) == dm.sampler.take(2)
    assert len(dm.val_sets["toy"]) == 4 and len(dm.val_dataloader()) == 1
