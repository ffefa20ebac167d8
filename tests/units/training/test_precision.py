"""--precision auto: bf16 only where bf16 is fast (CUDA, or a CPU whose bf16 GEMM is measured fast)."""
from __future__ import annotations

import torch

from common.training.precision import MIN_SPEEDUP, choose_bf16, gemm_seconds


def fake_timer(fp32_s: float, bf16_s: float):
    return lambda dtype: fp32_s if dtype == torch.float32 else bf16_s


def test_auto_follows_the_measured_gemm():
    cpu = torch.device("cpu")
    # AVX-512 BF16 (this project's dev box): ~2x faster in bf16
    assert choose_bf16("auto", cpu, fake_timer(3.2e-3, 1.3e-3))[0] is True
    # AVX2 only (the review's EPYC): bf16 falls back to a reference GEMM, 3-50x slower
    on, why = choose_bf16("auto", cpu, fake_timer(3.2e-3, 40e-3))
    assert on is False and "fp32" in why and "0.08x" in why
    assert choose_bf16("auto", cpu, fake_timer(1.0, 1.0 / (MIN_SPEEDUP * 0.99)))[0] is False  # a near-tie
    assert choose_bf16("auto", torch.device("cuda"), fake_timer(1.0, 100.0)) == (True, "auto: CUDA")
    assert choose_bf16("bf16", cpu, fake_timer(1.0, 100.0))[0] is True  # asked for: obeyed
    assert choose_bf16("fp32", cpu, fake_timer(100.0, 1.0))[0] is False


def test_the_timer_measures_both_dtypes():
    assert 0 < gemm_seconds(torch.float32, size=64, repeats=2) < 1
    assert 0 < gemm_seconds(torch.bfloat16, size=64, repeats=2) < 5
