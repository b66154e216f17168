"""eagle3data: two fixes for vLLM's CPU build at T > 0, a vLLM general plugin (loaded in every vLLM process,
before the worker registers its kernel shims). Copied by generate/backends/vllm_server.py (`with_cpu_fixes`)
beside its entry point; value/engine.py's docstring says why. Runs in the engine's venv: it imports no eagle3data.

1. `expand_kernel`'s CPU shim writes its output at the caller's dtype (vllm-project/vllm#55005): without it the
   rejection sampler reads uninitialised memory as the per-token temperature. Only where Triton does not run.
2. A seeded request's discarded sample (a chunked prefill's partial step) is undone by restoring the request's CPU
   generator's state, where vLLM calls `set_offset`, which CPU generators lack ("CPU Generator does not use offset":
   the engine dies). Only CPU generators are touched.
"""

import os


def register():
    done = []
    try:
        from vllm.triton_utils import HAS_TRITON
        from vllm.utils import cpu_triton_utils as cpu_tl
    except Exception as e:  # noqa: BLE001 - not a build with CPU shims
        done.append(f"expand: not applied ({e!r})")
    else:
        if HAS_TRITON:
            done.append("expand: not needed (Triton runs)")
        else:
            if not getattr(cpu_tl._expand_kernel_impl, "_eagle3data_fix", False):
                cpu_tl._expand_kernel_impl = _expand_kernel_impl
            done.append("expand: applied")
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:  # noqa: BLE001
        done.append(f"rewind: not applied ({e!r})")
    else:
        _patch_rewind(GPUModelRunner)
        done.append("rewind: applied")
    path = os.environ.get("EAGLE3DATA_VLLM_FIX_MARK")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} " + "; ".join(done) + "\n")


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """`expand_kernel`: request i's value (replace_from rewritten to replace_to) at tokens cu[i-1]..cu[i]."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    if cu.numel() == 0:
        return
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1])
    output[:n].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


_expand_kernel_impl._eagle3data_fix = True


def _patch_rewind(R):
    if getattr(R._bookkeeping_sync, "_eagle3data_fix", False):
        return
    sample, bookkeeping = R._sample, R._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        import numpy as np

        gens = self.input_batch.generators
        n = self.input_batch.num_reqs
        self._eagle3data_states = {int(i): gens[int(i)].get_state()
                                   for i in np.nonzero(self.discard_request_mask.np[:n])[0]
                                   if int(i) in gens and gens[int(i)].device.type == "cpu"}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        states, self._eagle3data_states = getattr(self, "_eagle3data_states", {}), {}
        gens = self.input_batch.generators
        held = {i: gens.pop(i) for i in states if i in gens}  # vLLM's set_offset rewind skips them
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, g in held.items():
                g.set_state(states[i])
                gens[i] = g

    _bookkeeping_sync._eagle3data_fix = True
    R._sample, R._bookkeeping_sync = _sample, _bookkeeping_sync
