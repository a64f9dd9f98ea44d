"""Policy objectives (DSPO Eq. 2, 6, 8, 11; DAPO) and KL estimators, against numbers computed by hand.

The hand batch: two groups of two sequences, L = 4, clip range [1 − 0.2, 1 + 0.28] = [0.8, 1.28].
Δ = logπθ − logπold on trained tokens; "*" marks positions with mask 0 (retrieved text / padding) holding garbage.

    seq  group  Â   mask        Δ                      |y|
    0    A      +1  1 1 0 0     0.3  0.1  *    *        2
    1    A      −1  1 1 1 1    −0.4 −0.4 −0.4 −0.4      4
    2    B      +2  1 0 1 0     0.5  *    0.3  *        2
    3    B      −1  1 1 1 0     0.6  0.3  0.3  *        3

exp values used below: e^0.1 = 1.1051709, e^0.2 = 1.2214028, e^0.3 = 1.3498588, e^0.4 = 1.4918247,
e^0.5 = 1.6487213, e^0.6 = 1.8221188, e^−0.4 = 0.6703200.
"""

import math

import pytest
import torch

from dspo.algorithms.blocks import loss_normalizer
from dspo.algorithms.losses import KL_ESTIMATORS, OBJECTIVES, ClipRange, kl_penalty, policy_loss

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
CLIP = ClipRange(CLIP_LOW, CLIP_HIGH)
GARBAGE = 5.0  # off-mask Δ; if it leaked into any ratio the expected numbers below would be far off

MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [1, 1, 1, 0]], dtype=torch.float64)
DELTA = torch.tensor(
    [
        [0.3, 0.1, GARBAGE, GARBAGE],
        [-0.4, -0.4, -0.4, -0.4],
        [0.5, GARBAGE, 0.3, GARBAGE],
        [0.6, 0.3, 0.3, GARBAGE],
    ],
    dtype=torch.float64,
)
ADV = torch.tensor([1.0, -1.0, 2.0, -1.0], dtype=torch.float64)
OLD = torch.full((4, 4), -1.0, dtype=torch.float64)


def _leaf(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


# ---------------------------------------------------------------- dspo / gspo: sequence ratio (Eq. 6) + clip (Eq. 11)
# s_0 = exp((0.3 + 0.1)/2) = e^0.2 = 1.2214028   Â>0, s ≤ 1.28     → unclipped   term  +1.2214028
# s_1 = exp(−0.4)          = 0.6703200           Â<0, s < 0.8      → clipped     term  0.8·(−1) = −0.8
# s_2 = exp((0.5 + 0.3)/2) = e^0.4 = 1.4918247   Â>0, s > 1.28     → clipped     term  1.28·2 = +2.56
# s_3 = exp((0.6+0.3+0.3)/3) = e^0.4 = 1.4918247 Â<0, s > 1.28: min picks s·Â (pessimistic) → unclipped  −1.4918247
# J = (1.2214028 − 0.8 + 2.56 − 1.4918247)/4 = 1.4895781/4 = 0.3723945 → loss −0.3723945
DSPO_LOSS = -0.3723945151
DSPO_STATS = {"clipfrac": 0.5, "ratio_mean": 1.2188430499, "ratio_min": 0.6703200460, "ratio_max": 1.4918246976}


@pytest.mark.parametrize("name", ["dspo", "gspo"])
def test_sequence_loss_hand_values(name: str) -> None:
    loss, stats = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    assert loss.item() == pytest.approx(DSPO_LOSS, abs=1e-8)
    for key, value in DSPO_STATS.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-9), key
        assert not stats[key].requires_grad


def test_sequence_loss_gradient_hand_values() -> None:
    # Eq. 8: ∂loss/∂logπθ(y_it) = −(1/N) s_i Â_i m_it / |y_i| where unclipped, 0 for a clipped sequence.
    #   seq 0: −(1/4)·1.2214028·(+1)/2 = −0.1526753 on its 2 tokens
    #   seq 3: −(1/4)·1.4918247·(−1)/3 = +0.1243187 on its 3 tokens
    #   seqs 1, 2 are clipped → 0; every off-mask position → 0
    logprobs = _leaf(OLD + DELTA)
    loss, _ = policy_loss("dspo", logprobs, OLD, ADV, MASK, CLIP)
    loss.backward()
    g0, g3 = -0.1526753448, 0.1243187248
    expected = torch.tensor(
        [[g0, g0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [g3, g3, g3, 0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-9, rtol=0)


def test_sequence_loss_gradient_matches_equation_8_random() -> None:
    gen = torch.Generator().manual_seed(0)
    n, length = 6, 9
    mask = (torch.rand(n, length, generator=gen) > 0.3).double()
    mask[2] = 0.0  # an empty sequence: no gradient, no NaN
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 3
    delta = (torch.rand(n, length, generator=gen, dtype=torch.float64) - 0.5) * 0.1  # |mean Δ| ≤ 0.05: inside the clip
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    logprobs = _leaf(old + delta)
    loss, stats = policy_loss("dspo", logprobs, old, adv, mask, CLIP)
    loss.backward()
    lengths = mask.sum(dim=1)
    s = torch.exp((delta * mask).sum(dim=1) / lengths.clamp(min=1))
    expected = -(1.0 / n) * (s * adv / lengths.clamp(min=1))[:, None] * mask
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-12, rtol=1e-10)
    assert torch.all(logprobs.grad[2] == 0)
    assert stats["clipfrac"].item() == 0.0


def test_clipped_sequence_has_zero_gradient_unclipped_side_does_not() -> None:
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    # row 0: Â>0 and s = e^0.5 = 1.6487 > 1.28 → clipped, no gradient
    # row 1: Â>0 and s = e^−0.5 = 0.6065 < 0.8 → min keeps s·Â: PPO never clips the side that lowers the objective
    logprobs = _leaf(torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]], dtype=torch.float64))
    loss, stats = policy_loss(
        "dspo", logprobs, old, torch.tensor([1.0, 1.0], dtype=torch.float64), mask, {"clip_low": 0.2, "clip_high": 0.28}
    )
    loss.backward()
    assert torch.all(logprobs.grad[0] == 0)
    # −(1/2)·0.6065307·1/3 = −0.1010884 per token
    torch.testing.assert_close(logprobs.grad[1], torch.full((3,), -0.1010884468, dtype=torch.float64))
    assert stats["clipfrac"].item() == 0.5


def test_on_policy_sequence_and_token_gradients_agree() -> None:
    # With logπθ = logπold (M = 1), s_i = r_it = 1: Eq. 8 and GRPO's gradient are both −(1/N) Â_i m_it/|y_i|.
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, -1.5, 1.0, 2.0], dtype=torch.float64)
    grads = {}
    for name in ("dspo", "grpo"):
        logprobs = _leaf(old)
        loss, _ = policy_loss(name, logprobs, old, adv, mask, CLIP)
        # on-policy value: −mean(Â) = −(0.5 − 1.5 + 1 + 2)/4 = −0.5
        assert loss.item() == pytest.approx(-0.5, abs=1e-12)
        loss.backward()
        grads[name] = logprobs.grad
    torch.testing.assert_close(grads["dspo"], grads["grpo"])
    # seq 1 has 4 trained tokens: −(1/4)·(−1.5)/4 = 0.09375
    assert grads["dspo"][1, 0].item() == pytest.approx(0.09375)


# ------------------------------------------------ grpo: token ratio, per-token clip, sequence mean (Eq. 2)
# token ratios r = e^Δ:
#   seq 0 (Â=+1): 1.3498588 > 1.28 → 1.28 (clipped), 1.1051709            mean (1.28 + 1.1051709)/2 = 1.1925855
#   seq 1 (Â=−1): 0.6703200 < 0.8 ×4 → −0.8 each (clipped)                  mean −0.8
#   seq 2 (Â=+2): 1.6487213, 1.3498588 > 1.28 → 2.56 each (clipped)         mean 2.56
#   seq 3 (Â=−1): 1.8221188, 1.3498588, 1.3498588, Â<0 → unclipped          mean −4.5218364/3 = −1.5072788
# J = (1.1925855 − 0.8 + 2.56 − 1.5072788)/4 = 0.3613267 → loss −0.3613267
# clipped tokens 1 + 4 + 2 + 0 = 7 of 11; token ratio mean 12.6567264/11 = 1.1506115, min 0.6703200, max 1.8221188
TOKEN_STATS = {"clipfrac": 7 / 11, "ratio_mean": 1.1506114912, "ratio_min": 0.6703200460, "ratio_max": 1.8221188004}


def test_grpo_hand_values() -> None:
    loss, stats = policy_loss("grpo", OLD + DELTA, OLD, ADV, MASK, CLIP)
    assert loss.item() == pytest.approx(-0.3613266635, abs=1e-8)
    for key, value in TOKEN_STATS.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-9), key


def test_grpo_gradient_hand_values() -> None:
    # unclipped token: ∂loss/∂logπθ = −(1/N)(1/|y_i|) Â_i r_it; clipped token: 0
    #   seq 0 token 1: −(1/4)(1/2)(+1)·1.1051709 = −0.1381464
    #   seq 3: −(1/4)(1/3)(−1)·r = r/12 → 1.8221188/12 = 0.1518432, 1.3498588/12 = 0.1124882
    logprobs = _leaf(OLD + DELTA)
    loss, _ = policy_loss("grpo", logprobs, OLD, ADV, MASK, CLIP)
    loss.backward()
    a, b, c = -0.1381463648, 0.1518432334, 0.1124882340
    expected = torch.tensor([[0, a, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [b, c, c, 0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-9, rtol=0)


# ------------------------------------------------ dapo: token ratio, clip-higher, token mean over the batch
# per-sequence token sums from the grpo table: 2.3851709, −3.2, 5.12, −4.5218364 → −0.2166655 over 11 tokens
# J = −0.0196969 → loss +0.0196969 (same per-token clipping, so the same stats)
def test_dapo_hand_values() -> None:
    loss, stats = policy_loss("dapo", OLD + DELTA, OLD, ADV, MASK, CLIP)
    assert loss.item() == pytest.approx(0.0196968634, abs=1e-8)
    for key, value in TOKEN_STATS.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-9), key


def test_dapo_weighs_tokens_grpo_weighs_sequences() -> None:
    # on-policy, r = 1: dapo gradient per trained token is −Â_i/T (T = 11 tokens), grpo's is −Â_i/(N |y_i|)
    logprobs = _leaf(OLD)
    loss, _ = policy_loss("dapo", logprobs, OLD, ADV, MASK, CLIP)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -(ADV[:, None] * MASK) / 11)


# ---------------------------------------------------------------- shared behaviour
ALL = ["dspo", "gspo", "grpo", "dapo"]


def test_registry_records_declare_units_levels_and_clip_ranges() -> None:
    """Issue 30: one record per objective. The four built-ins declare their own clip ranges (the YAML files in
    conf/algorithm/ state the same values: tests/test_configs.py)."""
    assert set(ALL) <= set(OBJECTIVES)
    assert OBJECTIVES["dspo"].loss is OBJECTIVES["gspo"].loss
    facts = {n: (OBJECTIVES[n].normalizer_unit, OBJECTIVES[n].ratio_level, OBJECTIVES[n].settings) for n in ALL}
    assert facts == {
        "dspo": ("sequence", "sequence", ClipRange(3e-4, 4e-4)),
        "gspo": ("sequence", "sequence", ClipRange(3e-4, 4e-4)),
        "grpo": ("sequence", "token", ClipRange(0.2, 0.2)),
        "dapo": ("token", "token", ClipRange(0.2, 0.28)),
    }
    with pytest.raises(KeyError, match=r"unknown objective 'ppo' \(config key algorithm.loss\)"):
        policy_loss("ppo", OLD, OLD, ADV, MASK, CLIP)


def test_settings_as_a_mapping_override_the_objectives_defaults() -> None:
    as_mapping, _ = policy_loss("dapo", OLD + DELTA, OLD, ADV, MASK, {"clip_high": 0.28})  # clip_low: dapo's 0.2
    assert as_mapping.item() == policy_loss("dapo", OLD + DELTA, OLD, ADV, MASK, CLIP)[0].item()
    defaults, _ = policy_loss("grpo", OLD + DELTA, OLD, ADV, MASK)  # grpo's 0.2 / 0.2
    assert defaults.item() == policy_loss("grpo", OLD + DELTA, OLD, ADV, MASK, ClipRange(0.2, 0.2))[0].item()
    with pytest.raises(ValueError, match=r"^algorithm.loss_kwargs.clip: objective 'dspo' has no setting 'clip' \("):
        policy_loss("dspo", OLD, OLD, ADV, MASK, {"clip": 0.2})
    with pytest.raises(ValueError, match="algorithm.loss_kwargs.clip_low/clip_high: need 0 <= clip_low < 1"):
        ClipRange(1.0, 0.2)


@pytest.mark.parametrize("name", ALL)
def test_non_finite_off_mask_values_do_not_leak(name: str) -> None:
    expected, _ = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    logprobs = (OLD + DELTA).masked_fill(MASK == 0, float("-inf"))
    old = OLD.masked_fill(MASK == 0, float("nan"))
    leaf = _leaf(logprobs)
    loss, stats = policy_loss(name, leaf, old, ADV, MASK, CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert torch.isfinite(leaf.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", ALL)
def test_mask_dtype_does_not_matter(name: str) -> None:
    ref, _ = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    for mask in (MASK.bool(), MASK.long(), MASK.float()):
        loss, _ = policy_loss(name, OLD + DELTA, OLD, ADV, mask, CLIP)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_all_empty_mask_gives_zero_loss_and_no_nan(name: str) -> None:
    leaf = _leaf(OLD + DELTA)
    loss, stats = policy_loss(name, leaf, OLD, ADV, torch.zeros_like(MASK), CLIP)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(leaf.grad == 0)
    assert stats["clipfrac"].item() == 0.0
    assert stats["ratio_mean"].item() == stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    # a caller that counts units over an empty mini-batch passes normalizer 0: still 0, not 0/0
    loss0, _ = policy_loss(name, OLD + DELTA, OLD, ADV, torch.zeros_like(MASK), CLIP, normalizer=0)
    assert loss0.item() == 0.0


@pytest.mark.parametrize(("name", "hand_sum"), [("dspo", -1.4895780606), ("grpo", -1.4453066539)])
def test_one_empty_sequence_counts_in_n_but_adds_nothing(name: str, hand_sum: float) -> None:
    # a 5th sequence (Â = +3) without trained tokens: the loss is the hand batch's sum over N = 5, its gradient is 0
    logprobs = _leaf(torch.cat([OLD + DELTA, torch.zeros(1, 4, dtype=torch.float64)]))
    old = torch.cat([OLD, torch.zeros(1, 4, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    adv = torch.cat([ADV, torch.tensor([3.0], dtype=torch.float64)])
    loss, stats = policy_loss(name, logprobs, old, adv, mask, CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(hand_sum / 5, abs=1e-8)
    assert torch.all(logprobs.grad[4] == 0)
    expected_stats = DSPO_STATS if name == "dspo" else TOKEN_STATS
    assert stats["clipfrac"].item() == pytest.approx(expected_stats["clipfrac"])  # the empty row is not counted


@pytest.mark.parametrize(("name", "units"), [("dspo", 4), ("grpo", 4), ("dapo", 11)])
def test_micro_batches_with_normalizer_sum_to_the_mini_batch_loss(name: str, units: int) -> None:
    # the hand batch has 4 sequences and 2 + 4 + 2 + 3 = 11 trained tokens
    assert loss_normalizer(OBJECTIVES[name].normalizer_unit, num_sequences=4, num_tokens=11.0) == units
    full, _ = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    parts = [
        policy_loss(name, (OLD + DELTA)[s], OLD[s], ADV[s], MASK[s], CLIP, normalizer=units)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-12)


def test_loss_normalizer_counts_the_objectives_unit() -> None:
    assert loss_normalizer("token", num_sequences=3, num_tokens=0.0) == 1.0  # empty mini-batch: at least 1
    assert loss_normalizer("sequence", num_sequences=3, num_tokens=0.0) == 3.0
    with pytest.raises(ValueError, match="unit must be one of"):
        loss_normalizer("word", 1, 1.0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_normalizer_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss("dspo", OLD, OLD, ADV, MASK, CLIP, normalizer=bad)


@pytest.mark.parametrize("name", ALL)
def test_dtypes(name: str) -> None:
    # bf16 logprobs are upcast: the loss is float32 and equals the float32 computation on the same (rounded) values
    lp16, old16 = (OLD + DELTA).bfloat16(), OLD.bfloat16()
    loss16, stats16 = policy_loss(name, lp16, old16, ADV.float(), MASK.bool(), CLIP)
    loss32, _ = policy_loss(name, lp16.float(), old16.float(), ADV.float(), MASK, CLIP)
    assert loss16.dtype == torch.float32
    assert stats16["ratio_mean"].dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), abs=1e-6)
    loss64, _ = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    assert loss64.dtype == torch.float64


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="one \\[N, L\\] shape"):
        policy_loss("dspo", OLD, OLD[:, :3], ADV, MASK, CLIP)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss("grpo", OLD, OLD, ADV[:3], MASK, CLIP)


# ---------------------------------------------------------------- KL estimators
# two trained tokens and one off-mask token: logπθ = [−1, −2, *], logπref = [−1.5, −1, *]
# → δ = logπref − logπθ = [−0.5, 1]
KL_LP = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
KL_REF = torch.tensor([[-1.5, -1.0, float("nan")]], dtype=torch.float64)
KL_MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", -0.25),  # logπθ − logπref = [0.5, −1] → mean −0.25
        ("k2", 0.3125),  # ½δ² = [0.125, 0.5] → mean 0.3125
        ("k3", 0.4124062441),  # e^δ − δ − 1 = [0.6065307 − 0.5, 2.7182818 − 2] = [0.1065307, 0.7182818] → 0.4124062
    ],
)
def test_kl_hand_values(kind: str, expected: float) -> None:
    assert kl_penalty(KL_LP, KL_REF, KL_MASK, kind=kind).item() == pytest.approx(expected, abs=1e-9)


def test_k3_gradient_hand_values() -> None:
    # ∂k3/∂logπθ = 1 − e^δ, divided by the 2 trained tokens: [(1 − 0.6065307)/2, (1 − 2.7182818)/2]
    leaf = _leaf(KL_LP)
    kl_penalty(leaf, KL_REF, KL_MASK, kind="k3").backward()
    expected = torch.tensor([[0.1967346701, -0.8591409142, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(leaf.grad, expected, atol=1e-9, rtol=0)


def test_kl_properties_and_errors() -> None:
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    same = torch.tensor([[-0.3, -2.0]])
    assert kl_penalty(same, same, torch.ones(1, 2), kind="k3").item() == 0.0
    assert kl_penalty(KL_LP, KL_REF, torch.zeros(1, 3), kind="k3").item() == 0.0  # empty mask: 0, not NaN
    # normalizer = the mini-batch's token count: micro-batch of 2 tokens in a mini-batch of 4 → half the mean
    half = kl_penalty(KL_LP, KL_REF, KL_MASK, kind="k1", normalizer=4)
    assert half.item() == pytest.approx(-0.125)
    with pytest.raises(KeyError, match="algorithm.kl_estimator"):
        kl_penalty(KL_LP, KL_REF, KL_MASK, kind="k4")
    with pytest.raises(ValueError, match="share one shape"):
        kl_penalty(KL_LP, KL_REF[:, :2], KL_MASK)
    assert math.isfinite(kl_penalty(KL_LP.bfloat16(), KL_REF.bfloat16(), KL_MASK).item())


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_token_level_objectives_take_one_advantage_per_token(name: str) -> None:
    """Per-turn credit: advantages [N, L]. Broadcasting the per-sequence ones gives the same loss; per-token values
    give, on-policy (s = 1), ∂loss/∂logπ_it = −A_it / T (dapo, T trained tokens) or −A_it / (N |y_i|) (grpo)."""
    per_sequence, _ = policy_loss(name, OLD + DELTA, OLD, ADV, MASK, CLIP)
    broadcast, _ = policy_loss(name, OLD + DELTA, OLD, ADV[:, None].expand_as(MASK).clone(), MASK, CLIP)
    assert broadcast.item() == pytest.approx(per_sequence.item(), abs=1e-12)
    per_token = torch.arange(16, dtype=torch.float64).reshape(4, 4) / 10 - 0.7
    logprobs = _leaf(OLD + DELTA)
    loss, _ = policy_loss(name, logprobs, logprobs.detach(), per_token, MASK, CLIP)
    loss.backward()
    scale = MASK.sum() if name == "dapo" else 4 * MASK.sum(dim=1, keepdim=True)
    torch.testing.assert_close(logprobs.grad, -per_token * MASK / scale)
    assert OBJECTIVES[name].token_advantages


def test_sequence_objectives_refuse_per_token_advantages() -> None:
    assert not OBJECTIVES["dspo"].token_advantages and not OBJECTIVES["gspo"].token_advantages
    with pytest.raises(ValueError, match=r"advantages must be \[N\]=4 \(per-token advantages need a token-level"):
        policy_loss("dspo", OLD + DELTA, OLD, torch.zeros(4, 4, dtype=torch.float64), MASK, CLIP)
    with pytest.raises(ValueError, match=r"advantages must be \[N\]=4 or \[N, L\], got \(4, 3\)"):
        policy_loss("dapo", OLD + DELTA, OLD, torch.zeros(4, 3, dtype=torch.float64), MASK, CLIP)
