"""verify-hidden's `sglang` recompute backend: a store made through SGLang is recomputed through SGLang.

`verify.command.BACKENDS["sglang"]` (the backend `verify-hidden` and 04's own verify pick for a store of
`hidden.backend: sglang`). 04's capture needs two servers, one per pass (`engines/sglang_capture.py`: the aux
states, then the final state after the norm), and with `hidden.sglang.launch` runs one at a time, so the
samples are not sent one by one as the pass reaches them: `verify_store` hands every picked sample's ids to
`prepare()` first, which runs 04's two passes over them (the same server commands, the same `/generate`
request, the same server-settings and reply checks: `StatesBackend`, `reply_rows`, through 04's `PassEngine`)
into a scratch folder in the store (`<hidden>/sglang_verify_*`: the aux rows staged as 04 stages them, then
each sample's stacked `[n, 4, hidden]` states in the store dtype), and `run(input_ids)` then serves the
stacked states of a prepared sequence (it refuses any other). `close()` deletes the folder.

The servers: `hidden.sglang.base_url` (aux) and `final_url` (final), the running ones 04 used; with `launch`,
an aux server started for the aux pass and stopped, then a final server (logs
`<run>/engine/sglang_verify_aux.log`, `sglang_verify_final.log`; 04's own capture logs stay as they were).
Whatever fails (a server that does not start or answer, settings or replies that 04 would refuse, a
stopped pass) is one VerifyError line naming the pass, the server and what failed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from eagle3data.core.params import RunParams
from eagle3data.core.progress import Progress
from eagle3data.generate.backends.engine import GenerateError, Job
from eagle3data.generate.backends.vllm_server import ServerError
from eagle3data.generate.run import run_engine
from eagle3data.hidden.engines.sglang_capture import (PassEngine, _server, aux_command, final_command,
                                                      sglang_layer_ids)
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import AUX_NAMES, HiddenError, _torch_dtype
from eagle3data.hidden.verify.checks import VerifyError

DATASET = "verify"  # the jobs' dataset name (their keys name the scratch files)


class RecomputePass(PassEngine):
    """04's pass engine with the recompute's ends: aux rows staged in the scratch `folder` (not the store's
    `sglang_aux/`), each sample's stacked states handed to `writer` (`_Stacked`), no ledger file and no
    progress.json of 04's (the failures are the verify's to report)."""

    def __init__(self, params: RunParams, jobs: list[Job], *, folder: Path, **kw: Any):
        super().__init__(params, jobs, progress=False, **kw)
        self.staging = folder
        self.progress = Progress(False)

    def write_ledger(self, status: str) -> None:
        return None


class _Stacked:
    """The final pass's writer: sample i's stacked states saved to `folder/states_<i>.safetensors` with its ids."""

    def __init__(self, folder: Path, ids: Sequence[tuple[int, ...]]):
        self.folder, self.ids = folder, ids
        self.paths: dict[int, Path] = {}

    def add(self, sample: Any, position: int, states: Any) -> None:
        import torch
        from safetensors.torch import save_file

        path = self.folder / f"states_{position}.safetensors"
        save_file({"states": states.contiguous(), "token_ids": torch.tensor(self.ids[position], dtype=torch.int64)},
                  str(path))
        self.paths[position] = path

    def flush(self) -> None:
        return None


class SGLangRecompute:
    """`prepare(id lists)` runs 04's two SGLang passes over the picked samples; `run(input_ids [1, n]) -> states
    [1, n, 4, hidden]` (the store's order and dtype) for a prepared sequence; `close()` deletes the scratch."""

    def __init__(self, params: RunParams, info: dict[str, Any], config: Any, layers: Any):
        self.params, self.config, self.layers = params, config, layers
        self.names = list(info["states"])
        self.dtype = _torch_dtype(info["dtype"])
        self.hidden_size = int(info["hidden_size"])
        self.folder: Path | None = None
        self.ready: dict[tuple[int, ...], Path] = {}

    def prepare(self, samples: Sequence[Sequence[int]]) -> None:
        """Both passes over the distinct id sequences of `samples` (aux server, then final server)."""
        seqs = list(dict.fromkeys(tuple(int(x) for x in ids) for ids in samples))
        if not seqs:
            return
        self.folder = Path(tempfile.mkdtemp(prefix="sglang_verify_", dir=hidden_dir(self.params)))
        jobs = [Job(DATASET, i, [], None, list(ids), prompt=(i, None)) for i, ids in enumerate(seqs)]
        self._pass("aux", jobs)
        out = _Stacked(self.folder, seqs)
        self._pass("final", jobs, out)
        self.ready = {seqs[i]: path for i, path in out.paths.items()}

    def _pass(self, kind: str, jobs: list[Job], writer: Any = None) -> None:
        p, s = self.params, self.params.hidden.sglang
        if kind == "aux":
            cmd, given = aux_command(p, self.layers, self.config, stage="verify_aux"), s.base_url
        else:
            cmd, given = final_command(p, stage="verify_final"), s.final_url
        where = f"launched server {cmd.base_url}" if s.launch else f"server {given}"
        what = f"recompute via SGLang, {kind} pass ({where})"
        try:
            with _server(p, cmd, given, progress=False) as (url, _launched):
                eng = RecomputePass(p, jobs, folder=self.folder, kind=kind, base_url=url, hidden_size=self.hidden_size,
                                    store_dtype=self.dtype, writer=writer,
                                    layer_ids=sglang_layer_ids(self.layers, self.config) if kind == "aux" else None)
                res = run_engine(eng)
        except (GenerateError, ServerError, HiddenError, httpx.HTTPError, OSError) as e:
            hint = "" if s.launch else ("; the recompute needs both servers answering (hidden.sglang.base_url, then "
                                        "final_url), or none: --recompute 0 / hidden.verify_recompute 0")
            raise VerifyError(f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}{hint}") from None
        if res.stop_reason:
            raise VerifyError(f"{what}: stopped ({res.stop_reason}) after {eng.done} of {len(jobs)} samples")
        if eng.failures:
            f = eng.failures[0]
            raise VerifyError(f"{what}: {len(eng.failures)} of {len(jobs)} samples failed; the first "
                              f"({len(jobs[int(f['sample_id'])].prompt_ids)} ids): {f['error']}")

    def run(self, input_ids: Any) -> Any:
        from safetensors.torch import load_file

        ids = tuple(int(x) for x in input_ids[0].tolist())
        path = self.ready.get(ids)
        if path is None:
            raise VerifyError(f"recompute via SGLang: a sequence of {len(ids)} ids that prepare() was not given (the "
                              f"{len(self.ready)} prepared are the picked samples' stored ids)")
        t = load_file(str(path))
        if t["token_ids"].tolist() != list(ids) or tuple(t["states"].shape) != (len(ids), len(self.names),
                                                                               self.hidden_size):
            raise VerifyError(f"recompute via SGLang: {path} does not hold this sample's states")
        return t["states"][None]

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.ready = {}


def sglang_backend(params: RunParams, info: dict[str, Any], config: Any, layers: Any) -> Callable[[], Any]:
    """The `sglang` recompute backend for a store (its `index.json` info) of the target whose layer plan is
    `layers` (`capture.layer_plan`), checked to capture the layers the store says and to hold what SGLang gives."""
    if list(layers.hf_indices) != list(info.get("hf_indices") or layers.hf_indices):
        raise VerifyError(f"the store holds HF indices {info.get('hf_indices')}, the model's layer plan is "
                          f"{list(layers.hf_indices)}: not the store's target")
    if params.hidden.sglang is None:
        raise VerifyError("recompute via SGLang needs the run's `hidden.sglang` section (base_url and final_url, or "
                          "launch: true)")
    if list(info.get("states") or []) != [*AUX_NAMES, "post_norm"]:
        raise VerifyError(f"recompute via SGLang gives the aux states and the final state after the norm; the store "
                          f"holds {info.get('states')}: recompute it with --backend hf or vllm")
    return lambda: SGLangRecompute(params, info, config, layers)
