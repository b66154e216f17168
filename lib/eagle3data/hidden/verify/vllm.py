"""verify-hidden's `vllm` recompute backend: a store made by vLLM is recomputed by a vLLM server.

`verify.command.BACKENDS["vllm"]` (the backend `verify-hidden` and 04's own verify pick for a store of
`hidden.backend: vllm`). Each sample picked for recompute goes to the server as 04 sent it (the one
request and reply of `engines.vllm_capture.HiddenBackend`: `prompt` = its ids, `max_tokens: 1`,
`return_token_ids`, the echoed ids checked), its file is read after its lock through 04's
`read_states` (the same checks, the same post-norm: the model's final norm in fp32) and deleted,
and verify compares every stored layer with it within the store dtype's tolerance.

The server: inside 04 (`run_extract`), the one its capture used (`engines.vllm_capture.vllm_session`:
`hidden.vllm.base_url`, or the launched one, stopped after the verify); from `verify-hidden`, the
run's `hidden.vllm.base_url`, or with `launch` a server started for the verify and stopped by
`close()`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import httpx

from eagle3data.core.params import RunParams
from eagle3data.generate.backends.engine import Job
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.generate.run import _run_async
from eagle3data.hidden.engines.vllm_capture import (HiddenBackend, final_norm, read_states, remove_engine_files,
                                                    run_lease, wait_unlocked)
from eagle3data.hidden.store.format import _torch_dtype
from eagle3data.hidden.verify.checks import VerifyError


class VLLMRecompute:
    """`run(input_ids [1, n]) -> states [1, n, S, hidden]` through a vLLM server, as `capture.Capture` runs the HF
    forward; `close()` stops a server started for it."""

    def __init__(self, params: RunParams, info: dict[str, Any], config: Any, layers: Any):
        self.params, self.v = params, params.hidden.vllm
        self.names = list(info["states"])
        self.dtype = _torch_dtype(info["dtype"])
        self.hidden_size = int(info["hidden_size"])
        self.norm = final_norm(params, config) if "post_norm" in self.names else None
        self._leases = contextlib.ExitStack()
        try:
            lease = self._leases.enter_context(run_lease(params, progress=False))
            self.base_url = lease.base_url(layers)
            self.backend = HiddenBackend(params)
            self.client = httpx.Client(base_url=self.base_url, timeout=self.v.timeout_s)

            async def preflight() -> None:  # the server serves the params' model (its served name is sent)
                async with httpx.AsyncClient(base_url=self.base_url, timeout=self.v.timeout_s) as c:
                    await self.backend.preflight(c)

            _run_async(preflight())
        except BaseException:
            self._leases.close()
            raise

    def run(self, input_ids: Any) -> Any:
        ids = [int(x) for x in input_ids[0].tolist()]
        job = Job("verify", "recompute", [], None, ids)
        t0 = time.perf_counter()
        try:
            r = self.client.post(self.backend.path, content=self.backend.build([job]), headers=self.backend.headers())
        except httpx.HTTPError as e:
            raise VerifyError(f"recompute via vLLM {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise VerifyError(f"recompute via vLLM {self.base_url}: {self.backend.path} answered {r.status_code}: "
                              f"{r.text[:200]}")
        path = None
        try:
            (rec,) = self.backend.parse([job], r.content, time.perf_counter() - t0)
            path = rec["hidden_states_path"]
            _run_async(wait_unlocked(path, self.v.lock_timeout_s))
            states = read_states(path, ids, self.hidden_size, self.names, self.norm, self.dtype)
        except ResponseError as e:
            raise VerifyError(f"recompute via vLLM {self.base_url}: {e}") from None
        finally:
            if path:
                remove_engine_files(path)
        return states[None]

    def close(self) -> None:
        self.client.close()
        self._leases.close()


def vllm_backend(params: RunParams, info: dict[str, Any], config: Any, layers: Any) -> Callable[[], Any]:
    """The `vllm` recompute backend for a store (its `index.json` info) of the target whose layer plan is
    `layers` (`capture.layer_plan`), checked to capture the layers the store says."""
    if list(layers.hf_indices) != list(info.get("hf_indices") or layers.hf_indices):
        raise VerifyError(f"the store holds HF indices {info.get('hf_indices')}, the model's layer plan is "
                          f"{list(layers.hf_indices)}: not the store's target")
    if params.hidden.vllm is None:
        raise VerifyError("recompute via vLLM needs the run's `hidden.vllm` section (base_url, or launch: true)")
    return lambda: VLLMRecompute(params, info, config, layers)
