"""Which precision 04 trains in when told `--precision auto`: bf16 only where bf16 is fast.

bf16 autocast pays on CUDA and on CPUs with native bf16 matmuls (AVX-512 BF16 / AMX: oneDNN kernels).
Elsewhere it is a trap: on an AMD EPYC with AVX2 only, a single-thread 2048x1024 @ 1024x1024 GEMM ran at
40-48 GFLOP/s in fp32 and 0.8-13.5 GFLOP/s in bf16 (PyTorch's reference cpublas fallback), and one bf16
step of 04 at the P2 shape had not finished after 270 CPU-s against ~55 in fp32. So on a CPU the choice
is measured at start-up: a small GEMM timed in both dtypes, best of a few runs, in this process's
thread setting. The choice and its reason are printed once by the caller.
"""
from __future__ import annotations

import time

import torch

# bf16 must be at least this much faster than fp32 on the CPU to be chosen: autocast adds casts, and a
# tie is not worth the lower precision.
MIN_SPEEDUP = 1.2
GEMM = 512  # square GEMM side: ~0.3 GFLOP, a few ms in fp32 on one core


def gemm_seconds(dtype: torch.dtype, size: int = GEMM, repeats: int = 5) -> float:
    """Best-of-`repeats` wall time of one size x size matmul in `dtype` on the CPU."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    a @ b  # warm-up: kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def choose_bf16(requested: str, device: torch.device, timer=gemm_seconds) -> tuple[bool, str]:
    """(train in bf16?, why) for --precision `requested` (auto | fp32 | bf16) on `device`."""
    if requested != "auto":
        return requested == "bf16", f"--precision {requested}"
    if device.type == "cuda":
        return True, "auto: CUDA"
    fp32, bf16 = timer(torch.float32), timer(torch.bfloat16)
    speedup = fp32 / bf16
    if speedup >= MIN_SPEEDUP:
        return True, (f"auto: this CPU's bf16 GEMM is {speedup:.1f}x its fp32 one (measured at start-up, "
                      f"{GEMM}x{GEMM}; native bf16 kernels)")
    return False, (f"auto: this CPU's bf16 GEMM is {speedup:.2f}x its fp32 one (measured at start-up, "
                   f"{GEMM}x{GEMM}; below {MIN_SPEEDUP}x, no fast bf16 kernels): fp32")
