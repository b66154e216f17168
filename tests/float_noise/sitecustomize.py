"""Another CPU's rounding, simulated: every float weight of every model transformers loads moves one ulp.

Python imports this module at start-up when its folder is on PYTHONPATH (`sitecustomize`), so the notebook
kernels nbval starts load it too. `EAGLE3DATA_FLOAT_NOISE=up|down` picks the direction (`torch.nextafter`
towards +inf or -inf). The states, norms and losses computed from the weights then differ in their last bits,
as they do between an AVX2 and an AMX machine (about 0.15% of bf16 state values and a few int8 codes per
million change), while every id, shape and verdict the code decides must not
(tests/test_golden_float_free.py).

Nothing is imported early: `AutoModelForCausalLM.from_pretrained` is wrapped when transformers' auto-model
module is first imported, so a kernel's other imports (tqdm's notebook detection among them) are as without it.
"""

import importlib.abc
import os
import sys

_DIRECTION = os.environ.get("EAGLE3DATA_FLOAT_NOISE", "")
_TARGET = "transformers.models.auto.modeling_auto"


def _nudge(module) -> None:
    auto = module.AutoModelForCausalLM
    orig = auto.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        import torch

        model = orig(cls, *args, **kwargs)
        towards = float("inf") if _DIRECTION == "up" else float("-inf")
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.copy_(torch.nextafter(p, torch.full_like(p, towards)))
        return model

    auto.from_pretrained = classmethod(from_pretrained)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the auto-model module is imported, wraps its loader to patch it once loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_nudge(module):
            exec_module(module)
            _nudge(module)

        spec.loader.exec_module = exec_and_nudge
        return spec


if _DIRECTION in ("up", "down"):
    sys.meta_path.insert(0, _Finder())
