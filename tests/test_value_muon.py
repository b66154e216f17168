"""06's Muon on a CPU without native bf16 matmul (value/muon_cpu.py): the float32 iteration is torch's own
(coefficients, steps, eps, transposes) within bf16's rounding, it is used exactly where `auto` says, and only
while the block runs."""

from __future__ import annotations

import pytest
import torch
from torch.optim import _muon

from eagle3data.value import muon_cpu
from eagle3data.value.muon_cpu import muon_ns, resolve_ns_dtype, zeropower_float32

COEF = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)


@pytest.mark.parametrize("shape", [(96, 256), (256, 96), (64, 64)])  # wide, tall (transposed), square
def test_the_float32_iteration_is_torchs_within_bf16_rounding(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    theirs = _muon._zeropower_via_newtonschulz(g, COEF, _muon.DEFAULT_NS_STEPS, _muon.EPS).float()
    ours = zeropower_float32(g, COEF, _muon.DEFAULT_NS_STEPS, _muon.EPS)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.03
    # a step off (one Newton-Schulz round fewer) is far outside that: the check tells the iterations apart
    fewer = zeropower_float32(g, COEF, _muon.DEFAULT_NS_STEPS - 2, _muon.EPS)
    assert ((fewer - theirs).norm() / theirs.norm()).item() > 0.1


def test_auto_keeps_torchs_bf16_where_the_hardware_has_it(monkeypatch):
    monkeypatch.setattr(muon_cpu, "native_bf16_cpu", lambda: False)
    assert resolve_ns_dtype("auto", "cpu") == "float32"
    assert resolve_ns_dtype("auto", "cuda") == resolve_ns_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_ns_dtype("bfloat16", "cpu") == "bfloat16" and resolve_ns_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(muon_cpu, "native_bf16_cpu", lambda: True)
    assert resolve_ns_dtype("auto", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="muon_ns_dtype"):
        resolve_ns_dtype("fp16", "cpu")


def test_a_muon_step_inside_the_block_orthogonalizes_in_float32_and_torchs_is_back_after():
    own = _muon._zeropower_via_newtonschulz
    seen = []

    def spy(grad, *a):
        seen.append(grad.dtype)
        return zeropower_float32(grad, *a)

    p = torch.nn.Parameter(torch.randn(32, 48))
    p.grad = torch.randn(32, 48)
    opt = torch.optim.Muon([p], lr=1e-3)
    with muon_ns("float32"):
        assert _muon._zeropower_via_newtonschulz is zeropower_float32
        _muon._zeropower_via_newtonschulz = spy
        opt.step()
    assert seen and _muon._zeropower_via_newtonschulz is own
    with muon_ns("bfloat16"):
        assert _muon._zeropower_via_newtonschulz is own
