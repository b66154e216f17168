"""`python -m eagle3data verify-hidden RUN_DIR`: the run's params, the recompute backends, the exit status.

A recompute backend is a factory of what `capture.Capture` is (`run(input_ids) -> states`,
`close()`), so the forward is 04's own: `hf` is `Capture` on the target loaded as 04 loads it;
`vllm` (`verify/vllm.py`) recomputes through a vLLM server, for a store that backend made; `sglang`
(`verify/sglang.py`) through 04's two SGLang passes, run over every picked sample before the pass
(its `prepare`); the run's `hidden.backend` picks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eagle3data.core.params import RunParams
from eagle3data.core.params.hidden import positions_problem
from eagle3data.core.provenance import params_of_run
from eagle3data.hidden.capture import Capture, layer_plan, load_config, load_extract_model
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import _torch_dtype
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.verify.checks import VerifyError
from eagle3data.hidden.verify.run import DEFAULT_POSITIONS, DEFAULT_RECOMPUTE, verify_store
from eagle3data.hidden.verify.sglang import sglang_backend
from eagle3data.hidden.verify.vllm import vllm_backend


def hf_backend(params: RunParams, info: dict[str, Any], config: Any, model: Any = None) -> Callable[[], Any]:
    """The HF forward of 04 (`Capture` on the target), checked to capture the layers the store says."""
    layers = layer_plan(params, config)
    if list(layers.hf_indices) != list(info.get("hf_indices") or layers.hf_indices):
        raise VerifyError(f"the store holds HF indices {info.get('hf_indices')}, the model's layer plan is "
                          f"{list(layers.hf_indices)}: not the store's target")

    def make() -> Capture:
        m = model if model is not None else load_extract_model(params)
        return Capture(m, layers, _torch_dtype(info["dtype"]), info.get("final_state", "both"))

    return make


def vllm_recompute(params: RunParams, info: dict[str, Any], config: Any, model: Any = None) -> Callable[[], Any]:
    """Through a vLLM server (`verify/vllm.py`: the run's `hidden.vllm`), for a store that backend made."""
    return vllm_backend(params, info, config, layer_plan(params, config))


def sglang_recompute(params: RunParams, info: dict[str, Any], config: Any, model: Any = None) -> Callable[[], Any]:
    """Through SGLang (`verify/sglang.py`: the run's `hidden.sglang`, 04's two passes over the picked samples), for a
    store that backend made."""
    return sglang_backend(params, info, config, layer_plan(params, config))


BACKENDS: dict[str, Callable[..., Callable[[], Any]]] = {"hf": hf_backend, "vllm": vllm_recompute,
                                                         "sglang": sglang_recompute}


def parse_recompute(value: str | None) -> int | str:
    """`--recompute N|all` (None: the default per shard)."""
    if value is None:
        return DEFAULT_RECOMPUTE
    if value == "all":
        return "all"
    try:
        n = int(value)
    except ValueError:
        raise VerifyError(f"verify-hidden --recompute {value!r}: a count of samples per shard, or `all`") from None
    if n < 0:
        raise VerifyError(f"verify-hidden --recompute {value!r}: must be >= 0")
    return n


def verify_cli(run: str, *, recompute: str | None, positions: int | None, out: str | None,
               backend: str | None = None) -> int:
    """Verify a run's store; print one line and each failing sample; exit 0 when all pass, 1 when any fails."""
    run_dir = Path(run)
    if positions is not None and (why := positions_problem(positions)):
        raise VerifyError(f"verify-hidden --positions {positions}: {why}")
    per_shard = parse_recompute(recompute)
    params = params_of_run(run_dir)
    info = HiddenReader(hidden_dir(params)).info
    config = load_config(params)
    make = BACKENDS[backend or params.hidden.backend](params, info, config)  # the backend that made the store
    res = verify_store(params, config=config, backend=make, recompute=per_shard,
                       positions=DEFAULT_POSITIONS if positions is None else positions, out=out)
    print(res.line())
    for why in (w for ws in res.summary["file_problems"].values() for w in ws):
        print(f"  FAIL {why}")
    for r in res.rows:
        if r["failed"]:
            print(f"  FAIL {r['key']}: {', '.join(r['failed'])}")
    for p in res.store_problems:
        print(f"  FAIL {p['check']}: {p['detail']}")
    return 0 if res.ok else 1
