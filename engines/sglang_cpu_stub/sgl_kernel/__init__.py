"""A STAND-IN for `sgl_kernel`, installed into the SGLang test engine's venv (`.sglang/`, `make sglang`) only.

It is not SGLang's kernel library and holds no kernel. SGLang's CPU build of `sgl_kernel` is not
on PyPI (its kernels need AVX-512/AMX and a source build), and with `SGLANG_USE_CPU_ENGINE=1`
SGLang 0.5.23 imports the CPU op names below when its modules load, whichever attention backend
is chosen. On the torch-native path eagle3data's tests run (`--attention-backend torch_native
--sampling-backend pytorch`, radix cache off, no speculative decoding) none of them is called, and
this package exists only so that those imports succeed. Importing it prints one line on stderr
(`STANDIN_LOADED ...`: the server log shows the stand-in was armed in that process); every function
raises `StandInCalled` if it is called, after one line on stderr (`STANDIN_CALLED <name>`) that the
tests look for in the server log: a call would mean that SGLang took a path whose results this
package cannot give.

No `torch.ops.sgl_kernel` op is registered, so SGLang's Intel AMX backend (which probes for
`torch.ops.sgl_kernel.convert_weight_packed`) stays off even on a CPU with AMX.
Never install this where SGLang serves for real (a GPU node has the real `sgl_kernel`).
"""

from __future__ import annotations

import sys

__version__ = "0.0.0+eagle3data.standin"
STANDIN = True  # what a test checks: this is the stand-in, not SGLang's library
STANDIN_CALLED = "STANDIN_CALLED"  # the stderr marker of a call
STANDIN_LOADED = "STANDIN_LOADED"  # the stderr marker of an import

# The names SGLang 0.5.23 imports from `sgl_kernel` at load with SGLANG_USE_CPU_ENGINE=1.
NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


class StandInCalled(RuntimeError):
    """A function of the stand-in was called: SGLang needed a CPU kernel that this package does not have."""


def _standin(name: str):
    def fn(*args, **kwargs):
        print(f"{STANDIN_CALLED} sgl_kernel.{name}", file=sys.stderr, flush=True)
        raise StandInCalled(f"sgl_kernel.{name} called: this sgl_kernel is eagle3data's test-engine stand-in "
                            "with no kernels (engines/sglang_cpu_stub); SGLang took a path that needs the real one")

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Stand-in for sgl_kernel.{name}: raises StandInCalled."
    return fn


for _name in NAMES:
    globals()[_name] = _standin(_name)
del _name

print(f"{STANDIN_LOADED} sgl_kernel stand-in of eagle3data's test engine (no kernels; every function raises if "
      "called)", file=sys.stderr, flush=True)

__all__ = [*NAMES, "StandInCalled", "STANDIN", "STANDIN_CALLED", "STANDIN_LOADED", "NAMES"]
