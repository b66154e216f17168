"""Muon's orthogonalization on a CPU without native bf16 matmul: the same iteration in float32.

speculators' default optimizer (`build_optimizers`: Muon on the draft's matrices) is `torch.optim.Muon`, whose
Newton-Schulz step (`torch.optim._muon._zeropower_via_newtonschulz`) casts each update to bfloat16 and runs
five rounds of three matmuls on it. A CPU with AVX512-BF16 or AMX does those in hardware; one with AVX2 only
(the AMD EPYC machines here) emulates them: a 2048 x 576 x 1536 bf16 matmul runs at 1.2 GFLOP/s where float32
runs at 102 (torch 2.13), and one Muon step over the SmolLM2 draft's matrices takes 23.9 s in bf16 against
0.77 s in float32, so 06 trained at ~34 tokens/s there against ~790 on an Intel Xeon with AMX.

`value.train.muon_ns_dtype: auto` (the default) keeps torch's bf16 where the hardware has it (a GPU, an
AVX512-BF16/AMX CPU) and runs the same iteration in float32 elsewhere (`zeropower_float32`: torch's
coefficients, steps, eps and transposes; its result is torch's within bf16's rounding, 1.1% relative on a
576 x 1536 update). No library offers the float32 variant: torch's function takes no dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NS_DTYPES = ("auto", "bfloat16", "float32")


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (the `avx512_bf16` or `amx_bf16` flag)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        import torch

        probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return bool(probe and probe())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_ns_dtype(setting: str, device: str) -> str:
    """`value.train.muon_ns_dtype` for this device: `auto` is bfloat16 (torch's own) on a GPU or a CPU with native
    bf16 matmul, float32 on a CPU without."""
    if setting not in NS_DTYPES:
        raise ValueError(f"value.train.muon_ns_dtype must be one of {', '.join(NS_DTYPES)}, not {setting!r}")
    if setting != "auto":
        return setting
    return "bfloat16" if not str(device).startswith("cpu") or native_bf16_cpu() else "float32"


def zeropower_float32(grad: Any, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> Any:
    """torch's `_zeropower_via_newtonschulz` (torch/optim/_muon.py, 2.13) with the update kept in float32."""
    import torch

    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.to(torch.float32)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def muon_ns(dtype: str) -> Iterator[None]:
    """While the block runs, torch's Muon orthogonalizes in `dtype` (float32: `zeropower_float32`; bfloat16:
    torch's own, untouched)."""
    if dtype != "float32":
        yield
        return
    from torch.optim import _muon

    own = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = zeropower_float32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = own
