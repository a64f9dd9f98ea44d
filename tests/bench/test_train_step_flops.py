"""bench/train_step.py's attention FLOPs: torch's FlopCounterMode counts none for the CPU attention kernel, so the
script counts the causal half of QKᵀ and PV itself (issue 40); checked against a hand computation."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def train_step():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("train_step")
    finally:
        sys.path.remove(str(BENCH))


def test_causal_attention_flops_by_hand(train_step) -> None:
    # B=1, Hq=2, L=4, d=dv=8: dense forward 2*1*2*4*4*(8+8) = 1,024; causal keeps (4+1)/(2*4) = 5/8 of it
    assert train_step.causal_attention_flops((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)) == 640
    assert train_step.causal_attention_flops((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), backward=True) == 1280
    # cross-attention shapes (Lq != Lk) are counted dense
    assert train_step.causal_attention_flops((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4)) == 2 * 2 * 3 * 8


def test_attention_on_cpu_is_counted_forward_and_backward(train_step) -> None:
    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    with FlopCounterMode(display=False) as plain:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    with FlopCounterMode(display=False, custom_mapping=train_step.attention_formulas()) as counted:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    forward = train_step.causal_attention_flops((2, 3, 16, 8), (2, 3, 16, 8), (2, 3, 16, 8))
    if plain.get_total_flops() == 0:  # the CPU kernel torch leaves uncounted: ours counts it
        assert counted.get_total_flops() == 3 * forward
    else:  # a kernel torch counts (dense): ours replaces its formula with the causal one
        assert counted.get_total_flops() == 3 * forward < plain.get_total_flops()
