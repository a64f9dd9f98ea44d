"""The detectors at their bars (issue 70, item 7: mutation testing of dspo/guard/): a value exactly at a threshold
(`drop`, `margin`, `low`, `high`, `max_ratio`, `max_truncated_rise`, `factor`, `max_rise`, `hold`) does not fire and
one past it does; `warmup` rounds cannot fire; a signal that is missing or not finite scores 0 and changes nothing; a
zero baseline scores a neutral round instead of dividing by zero; the reasons carry the numbers; a state written into
a checkpoint resumes the detector; a wrong setting names its key. Every expected value is computed by hand (the
values are chosen exact in binary floating point, so that "at the bar" means at it)."""

from __future__ import annotations

import copy
import math

import pytest

from dspo.guard.detectors import DETECTORS, Detector, RoundSignals, Verdict, build_detectors, register_detector


def detector(name: str, **settings) -> Detector:
    (built,) = build_detectors({name: settings}).values()
    return built


def feed(built: Detector, field: str, values) -> list[Verdict]:
    return [built.observe(RoundSignals(i, i + 1, **{field: v})) for i, v in enumerate(values)]


# ------------------------------------------------------------------------------------------------ reward_drop
def test_reward_drop_exactly_drop_below_its_best_does_not_count_and_past_it_does():
    # alpha 1: the EMA is the round's reward; best 0.8; 0.4 is 1 - 0.4 / 0.8 = 0.5 below: at the bar
    at_bar = feed(detector("reward_drop", alpha=1.0, drop=0.5, patience=1, warmup=0), "sampled_reward", [0.8, 0.4])
    assert at_bar[1].score == 0.5 and not at_bar[1].fired
    past = feed(detector("reward_drop", alpha=1.0, drop=0.5, patience=1, warmup=0), "sampled_reward", [0.8, 0.2])
    assert past[1].score == 0.75 and past[1].fired


def test_reward_drop_suspects_a_round_only_strictly_under_the_bar():
    """best x (1 - drop) = 0.8 x 0.5 = 0.4: a round of exactly 0.4 is not suspect, one of 0.375 is."""
    at_bar = feed(detector("reward_drop", drop=0.5, warmup=0), "sampled_reward", [0.8, 0.4])
    under = feed(detector("reward_drop", drop=0.5, warmup=0), "sampled_reward", [0.8, 0.375])
    assert [v.suspect for v in at_bar] == [False, False] and [v.suspect for v in under] == [False, True]


def test_reward_drop_cannot_fire_in_its_warm_up_rounds():
    """warmup=2: rounds 1 and 2 only watch; a collapse in round 2 counts from round 3 (patience 1)."""
    out = feed(
        detector("reward_drop", alpha=1.0, drop=0.5, patience=1, warmup=2), "sampled_reward", [0.8, 0.0, 0.0, 0.0]
    )
    assert [v.fired for v in out] == [False, False, True, True]
    assert [v.suspect for v in out] == [False, True, True, True]  # suspect during warm-up too: no rollback target


def test_reward_drop_without_a_positive_best_scores_zero_and_never_fires():
    """All-zero rewards (a task nothing solves yet) have no relative drop: score 0, no firing, nothing suspect; nor
    does a negative reward under a best of 0 (the bar `best x (1 - drop)` means nothing there)."""
    out = feed(detector("reward_drop", drop=0.5, patience=1, warmup=0), "sampled_reward", [0.0] * 5 + [-1.0])
    assert [(v.score, v.fired, v.suspect) for v in out] == [(0.0, False, False)] * 6


def test_reward_drop_counts_its_patience_afresh_after_a_rollback():
    """patience 2: one round below, a rollback, one round below: not two in a row (the count restarts at 0)."""
    built = detector("reward_drop", alpha=1.0, drop=0.5, patience=2, warmup=0)
    first = feed(built, "sampled_reward", [0.8, 0.1])
    assert not first[1].fired and built.state["below"] == 1
    built.after_rollback()
    again = built.observe(RoundSignals(2, 3, sampled_reward=0.1))  # 0.875 below the kept best 0.8
    assert again.score == pytest.approx(0.875) and not again.fired
    assert built.observe(RoundSignals(3, 4, sampled_reward=0.1)).fired  # the second in a row


def test_reward_drop_restarts_even_when_it_never_saw_a_finite_reward():
    """A rollback before reward_drop had an EMA (non_finite fired on the first round, whose reward was NaN) restarts
    it too; its first finite round then starts the EMA."""
    built = detector("reward_drop", warmup=0)
    assert built.observe(RoundSignals(0, 1, sampled_reward=math.nan)) == Verdict(0.0)
    built.after_rollback()
    verdict = built.observe(RoundSignals(1, 2, sampled_reward=0.5))
    assert (verdict.score, verdict.fired, built.state["ema"]) == (0.0, False, 0.5)


# ------------------------------------------------------------------------------------------------ val_drop
def test_val_drop_exactly_at_its_margin_does_not_fire_and_past_it_does():
    at_bar = feed(detector("val_drop", margin=0.25), "validation", [0.75, 0.5])
    assert at_bar[1] == Verdict(0.25, False, "validation 0.500 is 0.250 below its best 0.750 (bar 0.250)")
    past = feed(detector("val_drop", margin=0.25), "validation", [0.75, 0.4375])
    assert past[1].score == 0.3125 and past[1].fired


def test_val_drop_exactly_at_z_standard_errors_does_not_fire():
    """noise 0.125, z 2: the bar is 0.25 (over the 0.1 margin); a drop of 0.25 is noise, 0.3125 is not."""
    built = detector("val_drop")
    built.observe(RoundSignals(0, 0, validation=0.75, validation_noise=0.125))
    at_bar = built.observe(RoundSignals(1, 1, validation=0.5, validation_noise=0.125))
    assert at_bar == Verdict(0.25, False, "validation 0.500 is 0.250 below its best 0.750 (bar 0.250)")
    assert built.observe(RoundSignals(2, 2, validation=0.4375, validation_noise=0.125)).fired


def test_val_drop_between_validations_scores_the_last_drop_and_zero_before_any():
    """A round without a validation logs the last validation's drop (its curve does not fall back to 0 between
    validations), and 0 before the first one; it fires only on a new validation."""
    out = feed(detector("val_drop"), "validation", [None, 0.75, 0.5, None, None])
    assert [v.score for v in out] == [0.0, 0.0, 0.25, 0.25, 0.25]
    assert [v.fired for v in out] == [False, False, True, False, False]


# ------------------------------------------------------------------------------------------------ entropy
def test_entropy_exactly_at_low_or_high_does_not_fire():
    """warm-up level 1.0 (warmup 1): 0.1x and 3x are at the bars; 0.0625x and 3.25x are past them."""
    out = feed(detector("entropy", warmup=1, low=0.1, high=3.0), "entropy", [1.0, 0.1, 3.0, 0.0625, 3.25])
    assert [v.fired for v in out] == [False, False, False, True, True]
    assert out[1] == Verdict(pytest.approx(math.log(10)), False, "entropy 0.1000 is 0.10x its warm-up level 1.0000")


@pytest.mark.parametrize("warmup", [0, 1])
def test_entropy_takes_its_level_from_the_first_round_when_the_warm_up_is_short(warmup):
    """With warmup 0 or 1 the baseline is the first round's value alone: 0.08 after 1.0 is 0.08x (fires); averaging
    the second round in, (1.0 + 0.08) / 2, would make it 0.15x (no firing)."""
    out = feed(detector("entropy", warmup=warmup, low=0.1), "entropy", [1.0, 0.08])
    assert out[1].fired and out[1].score == pytest.approx(-math.log(0.08))


def test_entropy_of_zero_in_the_warm_up_scores_neutral_rounds():
    out = feed(detector("entropy", warmup=1), "entropy", [0.0, 0.0, 2.0])
    assert [(v.score, v.fired) for v in out] == [(0.0, False)] * 3
    assert out[2].reason == "entropy 2.0000 is 1.00x its warm-up level 0.0000"


# ------------------------------------------------------------------------------------------------ length
def test_length_exactly_at_max_ratio_or_max_truncated_rise_does_not_fire():
    built = detector("length", warmup=1, max_ratio=3.0, max_truncated_rise=0.5)
    out = [
        built.observe(RoundSignals(i, i + 1, response_tokens=tokens, truncated_share=share))
        for i, (tokens, share) in enumerate([(100.0, 0.25), (300.0, 0.75), (325.0, 0.25), (100.0, 0.875)])
    ]
    assert [v.fired for v in out] == [False, False, True, True]
    assert out[1] == Verdict(3.0, False, "length 3.00x its warm-up level, truncated share +0.50")


def test_length_without_a_truncated_share_watches_the_length_alone():
    out = feed(detector("length", warmup=1), "response_tokens", [100.0, 200.0, 325.0])
    assert [(v.score, v.fired) for v in out] == [(1.0, False), (2.0, False), (3.25, True)]
    assert out[1].reason == "length 2.00x its warm-up level, truncated share +0.00"


def test_length_is_relative_to_any_positive_warm_up_level_and_neutral_at_zero():
    """One-token answers in the warm-up (level 1.0): 4 tokens is 4x and fires; a level of 0 scores 1.0 (neutral)."""
    assert [v.fired for v in feed(detector("length", warmup=1), "response_tokens", [1.0, 4.0])] == [False, True]
    out = feed(detector("length", warmup=1), "response_tokens", [0.0, 50.0])
    assert [(v.score, v.fired) for v in out] == [(1.0, False), (1.0, False)]


# ------------------------------------------------------------------------------------------------ grad_spike
def test_grad_spike_exactly_factor_times_the_median_does_not_fire():
    at_bar = feed(detector("grad_spike", warmup=1, factor=10.0), "grad_norm", [1.0, 10.0])
    assert at_bar[1] == Verdict(10.0, False, "grad norm 10 is 10.0x the running median 1")
    past = feed(detector("grad_spike", warmup=1, factor=10.0), "grad_norm", [1.0, 10.5])
    assert past[1].score == 10.5 and past[1].fired


def test_grad_spike_cannot_fire_in_its_warm_up_rounds():
    out = feed(detector("grad_spike", warmup=2, factor=10.0), "grad_norm", [1.0, 50.0, 1.0])
    assert out[1].score == 50.0 and [v.fired for v in out] == [False, False, False]


def test_grad_spike_over_a_zero_median_scores_one():
    """Norms of 0 (nothing trained): the ratio is 1, not a division by zero."""
    out = feed(detector("grad_spike", warmup=0), "grad_norm", [0.0, 0.0, 3.0])
    assert [(v.score, v.fired) for v in out] == [(1.0, False)] * 3


# ------------------------------------------------------------------------------------------------ non_finite
def test_non_finite_says_how_many_steps_and_values():
    verdict = detector("non_finite").observe(
        RoundSignals(0, 1, sampled_reward=math.nan, grad_norm=math.inf, skipped_steps=1)
    )
    assert verdict == Verdict(3.0, True, "1 skipped steps, 3 non-finite values")


# ------------------------------------------------------------------------------------------------ no_search
def no_search_rounds(built: Detector, rounds) -> list[Verdict]:
    return [
        built.observe(RoundSignals(i, i + 1, no_search_share=share, searched_reward=searched))
        for i, (share, searched) in enumerate(rounds)
    ]


def test_no_search_exactly_max_rise_above_its_level_does_not_fire():
    built = detector("no_search", warmup=1, max_rise=0.5)
    out = no_search_rounds(built, [(0.25, 0.5), (0.75, 0.5), (0.875, 0.5)])
    assert [v.fired for v in out] == [False, False, True]
    assert out[1] == Verdict(0.5, False, "no-search share 0.75 (+0.50), searched holds")


def test_no_search_counts_a_searched_reward_exactly_hold_below_its_level_as_holding():
    """Level 0.5, hold 0.25: a searched reward of 0.25 still holds (fires), 0.125 does not (no hacking)."""
    holds = no_search_rounds(detector("no_search", warmup=1, hold=0.25), [(0.25, 0.5), (0.75, 0.25)])
    drops = no_search_rounds(detector("no_search", warmup=1, hold=0.25), [(0.25, 0.5), (0.75, 0.125)])
    assert holds[1].fired and not drops[1].fired


def test_no_search_without_a_searched_reward_fires_on_the_share_alone():
    """A round where no episode searched has no searched reward: nothing contradicts the hacking."""
    out = no_search_rounds(detector("no_search", warmup=1), [(0.25, None), (0.75, None)])
    assert [v.fired for v in out] == [False, True]


# ------------------------------------------------------------------------------------------------ every detector
@pytest.mark.parametrize(
    ("name", "field", "bad"),
    [
        ("reward_drop", "sampled_reward", math.nan),
        ("entropy", "entropy", math.nan),
        ("entropy", "entropy", None),
        ("length", "response_tokens", math.inf),
        ("length", "response_tokens", None),
        ("grad_spike", "grad_norm", math.nan),
        ("grad_spike", "grad_norm", None),
        ("no_search", "no_search_share", -math.inf),
        ("no_search", "no_search_share", None),
    ],
)
def test_a_missing_or_non_finite_signal_scores_zero_and_changes_nothing(name, field, bad):
    """non_finite's case: the detector logs 0 and keeps its state (a NaN would stay in a baseline for good)."""
    built = detector(name, warmup=1)
    feed(built, field, [1.0, 1.0])
    before = built.state_dict()
    assert built.observe(RoundSignals(2, 3, **{field: bad})) == Verdict(0.0)
    assert built.state_dict() == before


@pytest.mark.parametrize(
    ("name", "settings", "state", "signals", "fired"),
    [
        ("reward_drop", {"alpha": 1.0, "patience": 2}, {"seen": 5, "ema": 0.8, "best": 0.8, "below": 1},
         {"sampled_reward": 0.25}, True),
        ("val_drop", {}, {"seen": 0, "best": 0.75, "last": 0.5}, {}, False),
        ("entropy", {}, {"seen": 3, "baseline": 2.0, "baseline_n": 3}, {"entropy": 0.125}, True),
        ("length", {}, {"seen": 3, "tokens": 100.0, "tokens_n": 3, "truncated": 0.25, "truncated_n": 3},
         {"response_tokens": 100.0, "truncated_share": 0.75}, True),
        ("grad_spike", {}, {"seen": 5, "history": [1.0, 2.0, 1.0]}, {"grad_norm": 12.0}, True),
        ("no_search", {}, {"seen": 3, "share": 0.25, "share_n": 3, "searched": 0.5, "searched_n": 3},
         {"no_search_share": 0.75, "searched_reward": 0.45}, True),
    ],
)  # fmt: skip
def test_a_detector_resumes_from_the_state_a_checkpoint_holds(name, settings, state, signals, fired):
    """The state's keys are a checkpoint format: a run resumed from a checkpoint continues with its baselines (the
    warm-up is over), bests and counts. Values: reward_drop 0.25 is 69 % below 0.8, the second round in a row; val_drop
    carries its last drop (0.25) between validations; entropy 0.125 / 2.0 < 0.1; truncated share +0.5 > 0.3; grad norm
    12 / median 1 > 10; no-search share +0.5 while 0.45 >= 0.5 - 0.1 holds."""
    built = detector(name, **settings)
    built.load_state_dict(copy.deepcopy(state))  # as torch.load gives it: not the parameter's own lists
    verdict = built.observe(RoundSignals(9, 10, **signals))
    assert verdict.fired is fired
    if name == "val_drop":
        assert verdict.score == 0.25


# ------------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"entropy": {"action": "explode"}}, "guard.detectors.entropy: action='explode': choose one of warn, rollback, "
         "stop"),
        ({"entropy": {"warmup": -1}}, "guard.detectors.entropy: warmup=-1 must be >= 0"),
        ({"reward_drop": {"margins": 0.1}}, "guard.detectors.reward_drop.margins: detector 'reward_drop' has no "
         "setting 'margins' (its settings: action, warmup, alpha, drop, patience)"),
    ],
)  # fmt: skip
def test_a_wrong_detector_setting_is_refused_naming_its_key_once_and_the_choices(config, message):
    with pytest.raises(ValueError) as error:
        build_detectors(config)
    assert str(error.value) == message


def test_false_turns_a_detector_off_like_null():
    assert set(build_detectors({"entropy": False, "length": None, "val_drop": {}})) == {"val_drop"}


def test_a_detector_registered_by_a_user_module_is_built_by_its_name():
    @register_detector("test_plugin_detector")
    class Plugin(Detector):
        def observe(self, signals: RoundSignals) -> Verdict:
            return Verdict(1.0)

    try:
        assert DETECTORS["test_plugin_detector"] is Plugin and Plugin.name == "test_plugin_detector"
        (built,) = build_detectors({"test_plugin_detector": {"action": "warn"}}).values()
        assert isinstance(built, Plugin) and built.settings.action == "warn"
    finally:
        DETECTORS.pop("test_plugin_detector")
