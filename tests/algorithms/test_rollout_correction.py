"""Rollout-training mismatch correction (issue 16): weights of every mode against numbers computed by hand, their
effect on each objective's gradient under an injected engine/trainer mismatch, and the config checks.

The hand batch: d = logπ_old − logπ_engine on mask-1 tokens ("*" = mask 0, holding garbage), bounds [0.5, 2].

    seq  mask       d                       mean d   ρ = e^mean
    0    1 1 0 1    0.1  −0.3  *    0.5     0.1      1.1051709
    1    1 1 1 0    0.9   0.9  0.6  *       0.8      2.2255409  (> 2)
    2    1 1 0 0   −1.0  −0.2  *    *      −0.6      0.5488116
    3    0 0 0 0    (no trained token)                           weight 0 everywhere
    4    1 0 0 0   −0.8   *    *    *      −0.8      0.4493290  (< 0.5)

Token ratios r = e^d: e^0.1 = 1.1051709, e^−0.3 = 0.7408182, e^0.5 = 1.6487213, e^0.9 = 2.4596031, e^0.6 = 1.8221188,
e^−1 = 0.3678794, e^−0.2 = 0.8187308, e^−0.8 = 0.4493290. Nine mask-1 tokens.
"""

from dataclasses import asdict

import pytest
import torch

from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.losses import OBJECTIVES, policy_loss
from dspo.algorithms.rollout_correction import (
    CORRECTION_MODES,
    RolloutCorrectionConfig,
    correction_level,
    correction_weights,
)

GARBAGE = 5.0
MASK = torch.tensor(
    [[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
    dtype=torch.float64,
)
DIFF = torch.tensor(
    [
        [0.1, -0.3, GARBAGE, 0.5],
        [0.9, 0.9, 0.6, GARBAGE],
        [-1.0, -0.2, GARBAGE, GARBAGE],
        [GARBAGE, GARBAGE, GARBAGE, GARBAGE],
        [-0.8, GARBAGE, GARBAGE, GARBAGE],
    ],
    dtype=torch.float64,
)
ENGINE = torch.where(MASK.bool(), torch.tensor(-2.0, dtype=torch.float64), 0.0)  # 0.0 off-mask, as in a Trajectory
OLD = ENGINE + DIFF

R0, R1, R2, R4 = 1.1051709181, 2.2255409285, 0.5488116361, 0.4493289641  # ρ_i
# products P_i = e^(Σ d): e^0.3 = 1.3498588076, e^2.4 = 11.0231763806 (> 2), e^−1.2 = 0.3011942119, e^−0.8 = R4
P0, P2 = 1.3498588076, 0.3011942119
EXPECTED = {
    "none": [[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
    "token_tis": [
        [1.1051709181, 0.7408182207, 0, 1.6487212707],
        [2.0, 2.0, 1.8221188004, 0],
        [0.3678794412, 0.8187307531, 0, 0],
        [0, 0, 0, 0],
        [0.4493289641, 0, 0, 0],
    ],
    "token_mis": [  # masked IS: the ratio where 0.5 <= r <= 2, else 0 (issue 29: it was the indicator alone)
        [1.1051709181, 0.7408182207, 0, 1.6487212707],
        [0, 0, 1.8221188004, 0],
        [0, 0.8187307531, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ],
    "token_rs": [[1, 1, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    "seq_tis": [[R0, R0, 0, R0], [2.0, 2.0, 2.0, 0], [R2, R2, 0, 0], [0, 0, 0, 0], [R4, 0, 0, 0]],
    "seq_mis": [[R0, R0, 0, R0], [0, 0, 0, 0], [R2, R2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    "seq_rs": [[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    "seq_prod_tis": [[P0, P0, 0, P0], [2.0, 2.0, 2.0, 0], [P2, P2, 0, 0], [0, 0, 0, 0], [R4, 0, 0, 0]],
    "seq_prod_mis": [[P0, P0, 0, P0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # P2, R4 < 0.5
    "seq_prod_rs": [[1, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
}
# weight_mean = Σ weights / 9; masked_share = mask-1 tokens with weight 0 / 9
# token_tis: 3.4947104 + 5.8221188 + 1.1866102 + 0.4493290 = 10.9527684;  seq_tis: 3·R0 + 6 + 2·R2 + R4 = 10.8624649
# token_mis: 1.1051709 + 0.7408182 + 1.6487213 + 1.8221188 + 0.8187308 = 6.1355600;  seq_mis: 3·R0 + 2·R2 = 4.4131361
EXPECTED_WEIGHT_MEAN = {
    "none": 1.0,
    "token_tis": 10.9527684 / 9,
    "token_mis": 6.1355600 / 9,
    "token_rs": 5 / 9,
    "seq_tis": 10.8624649 / 9,
    "seq_mis": 4.4131361 / 9,
    "seq_rs": 5 / 9,
    "seq_prod_tis": (3 * P0 + 6 + 2 * P2 + R4) / 9,  # 11.1012938 / 9
    "seq_prod_mis": 3 * P0 / 9,
    "seq_prod_rs": 3 / 9,
}
EXPECTED_MASKED_SHARE = {
    "none": 0.0,
    "token_tis": 0.0,
    "token_mis": 4 / 9,
    "token_rs": 4 / 9,
    "seq_tis": 0.0,
    "seq_mis": 4 / 9,
    "seq_rs": 4 / 9,
    "seq_prod_tis": 0.0,
    "seq_prod_mis": 6 / 9,
    "seq_prod_rs": 6 / 9,
}
# |d| summed: 0.9 + 2.4 + 1.2 + 0.8 = 5.3.  k3 = e^d − d − 1 summed over the nine tokens:
# 0.0051709 + 0.0408182 + 0.1487213 + 2·0.5596031 + 0.2221188 + 0.3678794 + 0.0187308 + 0.2493290 = 2.1719746
DIFF_ABS_MEAN, KL_K3 = 5.3 / 9, 2.1719746 / 9


@pytest.mark.parametrize("mode", sorted(CORRECTION_MODES))
def test_weights_and_stats_hand_values(mode: str) -> None:
    weights, stats = correction_weights(OLD, ENGINE, MASK, mode, low=0.5, high=2.0)
    torch.testing.assert_close(weights, torch.tensor(EXPECTED[mode], dtype=torch.float64), atol=1e-8, rtol=0)
    assert stats["logprob_diff_abs_mean"].item() == pytest.approx(DIFF_ABS_MEAN, abs=1e-7)
    assert stats["kl_k3"].item() == pytest.approx(KL_K3, abs=1e-7)
    assert stats["weight_mean"].item() == pytest.approx(EXPECTED_WEIGHT_MEAN[mode], abs=1e-7)
    assert stats["masked_share"].item() == pytest.approx(EXPECTED_MASKED_SHARE[mode], abs=1e-12)


def test_bounds_are_inclusive_and_configurable() -> None:
    mask = torch.ones(1, 3, dtype=torch.float64)
    old = torch.log(torch.tensor([[0.8, 1.25, 1.3]], dtype=torch.float64))  # engine logprob 0: r = 0.8, 1.25, 1.3
    engine = torch.zeros_like(old)
    weights, _ = correction_weights(old, engine, mask, "token_rs", low=0.8, high=1.25)
    assert weights.tolist() == [[1.0, 1.0, 0.0]]
    weights, _ = correction_weights(old, engine, mask, "token_mis", low=0.8, high=1.25)
    torch.testing.assert_close(weights, torch.tensor([[0.8, 1.25, 0.0]], dtype=torch.float64))
    weights, _ = correction_weights(old, engine, mask, "token_tis", low=0.8, high=1.25)
    torch.testing.assert_close(weights, torch.tensor([[0.8, 1.25, 1.25]], dtype=torch.float64))


def test_no_gradient_non_finite_off_mask_and_empty_batch() -> None:
    old = OLD.clone().requires_grad_(True)
    engine = ENGINE.masked_fill(~MASK.bool(), float("-inf"))  # padding that holds -inf must not leak
    old_bad = old.masked_fill(~MASK.bool(), float("nan"))
    weights, stats = correction_weights(old_bad, engine, MASK, "seq_tis", high=2.0)
    assert not weights.requires_grad and all(not v.requires_grad for v in stats.values())
    torch.testing.assert_close(weights, torch.tensor(EXPECTED["seq_tis"], dtype=torch.float64), atol=1e-8, rtol=0)
    assert all(torch.isfinite(v) for v in stats.values())
    empty = torch.zeros(2, 3)
    weights, stats = correction_weights(empty, empty, empty, "seq_mis")
    assert weights.eq(0).all()
    assert {k: v.item() for k, v in stats.items()} == {
        "logprob_diff_abs_mean": 0.0,
        "kl_k3": 0.0,
        "weight_mean": 1.0,
        "masked_share": 0.0,
        "weight_min": 1.0,
        "ess": 1.0,
    }


def test_kl_k3_stays_accurate_and_non_negative_for_float_noise_differences() -> None:
    """fp32 engine and trainer differ by ~1e-7 (measured in the e2e run); exp(d) − d − 1 in float32 went negative."""
    mask = torch.ones(1, 4)
    diff = torch.tensor([[3e-7, -2e-7, 1e-7, -4e-7]])
    engine = torch.full((1, 4), -3.0)
    _, stats = correction_weights(engine + diff, engine, mask, "none")
    d = ((engine + diff) - engine).double()  # the float32 differences as they reach the function
    assert stats["kl_k3"].item() == pytest.approx(float((d.square() / 2).mean()), rel=1e-3)
    assert stats["kl_k3"].item() > 0


def test_float32_inputs_and_shape_and_mode_errors() -> None:
    weights, stats = correction_weights(OLD.bfloat16(), ENGINE.bfloat16(), MASK.bool(), "token_tis")
    assert weights.dtype == torch.float32 and stats["kl_k3"].dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[N, L\]"):
        correction_weights(OLD, ENGINE[:, :3], MASK, "none")
    with pytest.raises(KeyError, match="algorithm.rollout_correction.mode"):
        correction_weights(OLD, ENGINE, MASK, "seq_is")


# ------------------------------------------------------------------ injected mismatch: weights reach the gradients
# M = 1: logπ_old = detached current logπ, so s_i = r_it = 1 (never clipped) and, with loss = −J,
#   dspo/gspo: ∂loss/∂logπ_it = −w_i Â_i / (N |y_i|)           (Eq. 8 times the sequence weight)
#   grpo:      ∂loss/∂logπ_it = −w_it Â_i / (N |y_i|)
#   dapo:      ∂loss/∂logπ_it = −w_it Â_i / T                   (T = mask-1 tokens of the batch)
# The engine is perturbed per sequence: seq 0 by −0.2 (r = e^0.2), seq 1 by +1 (r = e^−1 < 0.5), seq 2 not at all.
INJECT_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
SHIFT = torch.tensor([[-0.2], [1.0], [0.0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
LOGPROBS = torch.tensor(
    [[-1.2, -0.3, -2.0, -9.0], [-0.7, -1.1, -9.0, -9.0], [-0.4, -0.9, -1.6, -0.2]], dtype=torch.float64
)
E02 = 1.2214027582  # e^0.2


@pytest.mark.parametrize(
    ("loss", "mode", "seq_weight"),
    [
        ("dspo", "seq_tis", [E02, 0.3678794412, 1.0]),
        ("gspo", "seq_mis", [E02, 0.0, 1.0]),
        ("gspo", "seq_rs", [1.0, 0.0, 1.0]),
        ("grpo", "seq_tis", [E02, 0.3678794412, 1.0]),
        ("grpo", "token_mis", [E02, 0.0, 1.0]),
        ("grpo", "token_rs", [1.0, 0.0, 1.0]),
        ("dapo", "token_tis", [E02, 0.3678794412, 1.0]),
        ("dapo", "none", [1.0, 1.0, 1.0]),
    ],
)
def test_injected_mismatch_gives_expected_weights_and_gradients(loss: str, mode: str, seq_weight: list[float]) -> None:
    logprobs = LOGPROBS.clone().requires_grad_(True)
    old = logprobs.detach()
    engine = torch.where(INJECT_MASK.bool(), old + SHIFT, 0.0)
    weights, stats = correction_weights(old, engine, INJECT_MASK, mode, low=0.5, high=2.0)
    expected_w = torch.tensor(seq_weight, dtype=torch.float64)[:, None] * INJECT_MASK
    torch.testing.assert_close(weights, expected_w, atol=1e-9, rtol=0)
    assert stats["logprob_diff_abs_mean"].item() == pytest.approx((3 * 0.2 + 2 * 1.0) / 9)
    out, _ = policy_loss(loss, logprobs, old, ADV, INJECT_MASK, {"clip_low": 0.2, "clip_high": 0.28}, weights=weights)
    out.backward()
    lengths = INJECT_MASK.sum(1, keepdim=True)
    if loss == "dapo":
        expected = -expected_w * ADV[:, None] / INJECT_MASK.sum()
    else:
        expected = -expected_w * ADV[:, None] / (3 * lengths)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_weights_none_and_ones_leave_every_objective_unchanged(name: str) -> None:
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 4, dtype=torch.float64) - 1).requires_grad_(True)
    old = logprobs.detach() + 0.01 * torch.randn(3, 4, dtype=torch.float64)
    plain, plain_stats = policy_loss(name, logprobs, old, ADV, INJECT_MASK, {"clip_low": 0.2, "clip_high": 0.28})
    ones, ones_stats = policy_loss(
        name, logprobs, old, ADV, INJECT_MASK, {"clip_low": 0.2, "clip_high": 0.28}, weights=INJECT_MASK.clone()
    )
    assert plain.item() == ones.item() and plain_stats == ones_stats


def test_sequence_objective_refuses_weights_varying_within_a_sequence() -> None:
    weights, _ = correction_weights(OLD, ENGINE, MASK, "token_tis")
    adv = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.mode"):
        policy_loss("dspo", OLD.clone(), OLD, adv, MASK, {"clip_low": 3e-4, "clip_high": 4e-4}, weights=weights)
    with pytest.raises(ValueError, match="mask's shape"):
        policy_loss("dapo", OLD.clone(), OLD, adv, MASK, {"clip_low": 0.2, "clip_high": 0.28}, weights=weights[:, :2])


# ------------------------------------------------------------------------------------------------- config
def test_every_objective_has_a_ratio_level_and_every_mode_a_level() -> None:
    assert {OBJECTIVES[name].ratio_level for name in OBJECTIVES} <= {"token", "sequence"}
    assert {correction_level(m) for m in CORRECTION_MODES} == {"token", "sequence"}


def test_config_accepts_a_dict_and_stays_plain_for_checkpoints(tmp_path) -> None:
    config = AlgorithmConfig(loss="dapo", rollout_correction={"mode": "token_mis", "low": 0.25, "high": 4})
    assert config.rollout_correction == RolloutCorrectionConfig("token_mis", 0.25, 4.0)
    hparams = asdict(config)
    assert hparams["rollout_correction"] == {"mode": "token_mis", "low": 0.25, "high": 4.0}
    torch.save({"algorithm": hparams}, tmp_path / "h.pt")
    loaded = torch.load(tmp_path / "h.pt", weights_only=True)["algorithm"]
    assert AlgorithmConfig(**loaded) == config
    assert AlgorithmConfig().rollout_correction.mode == "seq_tis"  # the dataclass mirrors conf/algorithm/dspo.yaml


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"loss": "dspo", "rollout_correction": {"mode": "token_tis"}}, "algorithm.rollout_correction.mode"),
        ({"loss": "gspo", "rollout_correction": {"mode": "token_mis"}}, "algorithm.rollout_correction.mode"),
        ({"rollout_correction": {"mode": "tis"}}, "algorithm.rollout_correction.mode"),
        ({"rollout_correction": {"mode": "seq_mis", "low": 1.5}}, "algorithm.rollout_correction.low/high"),
        ({"rollout_correction": {"mode": "seq_tis", "high": 0.9}}, "algorithm.rollout_correction.low/high"),
        ({"rollout_correction": {"mode": "seq_tis", "cap": 2}}, "algorithm.rollout_correction"),
        ({"rollout_correction": "seq_tis"}, "algorithm.rollout_correction"),
    ],
)
def test_config_errors_name_the_key(overrides: dict, key: str) -> None:
    with pytest.raises((ValueError, KeyError, TypeError), match=key):
        AlgorithmConfig(**overrides)


def test_sequence_modes_allowed_on_token_objectives() -> None:
    for loss in ("grpo", "dapo"):
        for mode in CORRECTION_MODES:
            assert AlgorithmConfig(loss=loss, rollout_correction={"mode": mode}).rollout_correction.mode == mode


@pytest.mark.parametrize(
    ("algorithm", "mode"), [("dspo", "seq_tis"), ("gspo", "seq_tis"), ("dapo", "token_tis"), ("grpo", "token_tis")]
)
def test_algorithm_yaml_defaults_reach_the_module_as_plain_hyperparameters(algorithm: str, mode: str, tmp_path) -> None:
    """As dspo.train.build does: `_convert_="all"` hands the nested block over as a dict; hparams stay plain."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from dspo.train import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"algorithm={algorithm}", f"output_dir={tmp_path}"])
        bad = compose(config_name="train", overrides=[f"algorithm={algorithm}", "algorithm.rollout_correction.mode=x"])
    module = instantiate(cfg.module, _convert_="all")
    assert module.algo.rollout_correction == RolloutCorrectionConfig(mode, 0.5, 2.0)
    torch.save(dict(module.hparams), tmp_path / "hparams.pt")
    loaded = torch.load(tmp_path / "hparams.pt", weights_only=True)
    assert AlgorithmConfig(**loaded["algorithm"]) == module.algo
    with pytest.raises(Exception, match="algorithm.rollout_correction.mode"):
        instantiate(bad.algorithm)
