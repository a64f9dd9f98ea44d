"""The guard's ledger of checkpoints by policy version (`dspo.guard.health.HealthLedger`, issue 70) on its own: which
checkpoint waits, which one becomes healthy after a clean round, which ones a bad round drops, which one a rollback may
go to; each transition at its boundary (a version equal to the round's oldest or newest, to `last_bad`, to the
bound)."""

from __future__ import annotations

import io

import torch

from dspo.guard.health import HealthLedger
from dspo.types import SavedCheckpoint


def ckpt(version: int) -> SavedCheckpoint:
    return SavedCheckpoint(version, 2 * version, f"/run/checkpoints/step{2 * version:05d}.ckpt")


def test_a_checkpoint_waits_once_and_only_when_newer_than_every_known_one():
    ledger = HealthLedger()
    assert ledger.saved(ckpt(2)) is True
    assert ledger.saved(ckpt(2)) is False  # the same round checkpoint, seen again at the next round: not twice
    assert ledger.saved(ckpt(1)) is False
    assert ledger.saved(ckpt(3)) is True and ledger.waiting == [ckpt(2), ckpt(3)]


def test_a_checkpoint_already_judged_healthy_does_not_wait_again():
    """Saved every 10 rounds, the newest checkpoint is offered at every round; once healthy it is not judged again."""
    ledger = HealthLedger()
    ledger.saved(ckpt(5))
    assert ledger.clean(5) == (ckpt(5), [ckpt(5)])
    assert ledger.saved(ckpt(5)) is False and ledger.saved(ckpt(4)) is False
    assert ledger.waiting == [] and ledger.healthy == ckpt(5)


def test_a_checkpoint_of_a_version_that_sampled_a_bad_round_never_waits():
    ledger = HealthLedger()
    assert ledger.bad(3) == [] and ledger.last_bad == 3
    assert ledger.saved(ckpt(3)) is False and ledger.saved(ckpt(4)) is True


def test_a_clean_round_judges_the_checkpoints_up_to_its_oldest_sampling_version_and_promotes_the_newest():
    ledger = HealthLedger()
    for version in (1, 2, 3):
        ledger.saved(ckpt(version))
    promoted, judged = ledger.clean(2)  # sampled by versions >= 2: checkpoints 1 and 2 are judged, 3 waits on
    assert (promoted, judged) == (ckpt(2), [ckpt(1), ckpt(2)])
    assert ledger.healthy == ckpt(2) and ledger.waiting == [ckpt(3)]
    assert ledger.clean(2) == (None, []) and ledger.healthy == ckpt(2)  # nothing left to judge: healthy stays


def test_a_clean_round_promotes_no_checkpoint_of_a_bad_version():
    ledger = HealthLedger()
    ledger.saved(ckpt(1))
    ledger.saved(ckpt(2))
    assert ledger.bad(1) == [ckpt(1)]
    assert ledger.clean(2) == (ckpt(2), [ckpt(2)])
    ledger.saved(ckpt(3))
    ledger.bad(4)  # partial rollouts: a round sampled up to version 4 was bad, after 3 was saved
    assert ledger.waiting == [] and ledger.clean(5) == (None, []) and ledger.healthy == ckpt(2)


def test_a_bad_round_drops_every_waiting_checkpoint_up_to_its_newest_sampling_version():
    ledger = HealthLedger()
    for version in (1, 2, 3):
        ledger.saved(ckpt(version))
    assert ledger.bad(2) == [ckpt(1), ckpt(2)] and ledger.waiting == [ckpt(3)]
    assert ledger.bad(1) == [] and ledger.last_bad == 2  # an older bad round does not move last_bad back


def test_a_rollback_target_must_be_older_than_the_bad_rounds_oldest_sampling_version():
    ledger = HealthLedger(healthy=ckpt(3))
    assert ledger.target(3) is None  # version 3's own weights sampled the bad round
    assert ledger.target(4) == ckpt(3) and ledger.target(None) == ckpt(3)
    assert HealthLedger().target(None) is None


def test_the_ledger_round_trips_through_a_weights_only_checkpoint():
    ledger = HealthLedger(waiting=[ckpt(4), ckpt(5)], healthy=ckpt(3), last_bad=2)
    buffer = io.BytesIO()
    torch.save({"ledger": ledger.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["ledger"]
    assert HealthLedger.from_state(state) == ledger
    assert HealthLedger.from_state(HealthLedger().state_dict()) == HealthLedger()
