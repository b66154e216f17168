"""04 through SGLang servers (`hidden.backend: sglang`): two passes, the aux states then the final one.

SGLang returns hidden states in the `/generate` reply (`meta_info.hidden_states`, JSON floats): with
`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids
...` the three aux layers concatenated `[n, 3H]` *instead of* the final state; with
`--enable-return-hidden-states` the final state after the norm `[n, H]`. A server does one or the
other, and cannot capture the last layer's output before the norm (engines/README.md), so:

1. **aux pass**: each mix sample is one request (`input_ids` = its ids, `max_new_tokens: 1`,
   `return_hidden_states: true`) to the aux server; its rows `[n, 3, H]` (the prefill block: exactly
   n rows) are written in the store dtype to a staging file `<hidden>/sglang_aux/<key hash>.safetensors`
   (written then renamed).
2. **final pass**: each staged sample goes to the final server; its `[n, H]` post-norm rows are stacked
   after the staged aux rows and handed to the store's one writer; once the pass ends, the staging
   files of the stored samples are deleted.

Both servers run with the radix cache off (a cached prefix shrinks the prefill block) and each reply
is checked: `meta_info.prompt_tokens` = n, `cached_tokens` = 0, a first block of exactly n rows of the
pass's width, finite. The layer ids are the one layer plan's HF indices in SGLang's convention
(`sglang_layer_ids`). The final state is `post_norm` only (params refuse `pre_norm`/`both` for this
backend). With `launch`, 04 starts the aux server, runs pass 1, stops it, then the final server
for pass 2; otherwise `hidden.sglang.base_url` (aux) and `hidden.sglang.final_url` (final) are two
running servers. Resume: a sample in the store is skipped; one staged is not sent to the aux server
again. The client is 01's HTTP engine (requests in flight, retries, Ctrl-C/`STOP`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import orjson

from eagle3data.core.errors import UserInputError
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import AuxLayers, get_profile
from eagle3data.core.progress import Progress, capture_line
from eagle3data.generate.backends.engine import Engine, EngineSettings, GenerateError, Job, record_dict
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.generate.backends.sglang import SGLangBackend
from eagle3data.generate.backends.sglang_server import SGLangServer, sglang_command
from eagle3data.generate.ledger import DatasetLedger, write_ledger
from eagle3data.generate.run import run_engine
from eagle3data.hidden.engines.liveness import WatchedEngine, engine_died, server_death
from eagle3data.hidden.engines.settings import chunked_prefill_problem
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import AUX_NAMES, HiddenError, state_names

STAGE = "04_extract_hidden"
STAGING = "sglang_aux"

# SGLang 0.5.23's `set_eagle3_layers_to_capture` (srt/models/): an id X captures the input of layer X+1, HF index
# X+1, except in these models, which add the 1 only when the first id is 1 and otherwise read the ids as HF indices.
FIRST_ID_RULE = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                           "MistralLarge3ForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM",
                           "KimiK25ForConditionalGeneration"})


class SGLangHiddenError(HiddenError, UserInputError):
    """04 cannot run through SGLang as configured: one line says why."""


def sglang_layer_ids(layers: AuxLayers, config: Any) -> list[int]:
    """The `--return-aux-hidden-state-layer-ids` that make SGLang capture HF `hidden_states[hf_indices]`."""
    hf = list(layers.hf_indices)
    archs = set(getattr(config, "architectures", None) or [])
    if archs & FIRST_ID_RULE and hf[0] != 2:
        if hf[0] == 1:
            raise SGLangHiddenError(f"{sorted(archs & FIRST_ID_RULE)[0]}: SGLang reads aux layer ids starting with 1 "
                                    f"as layer outputs (+1) and others as HF indices, so HF indices {hf} cannot be "
                                    "named to it; use hidden.backend vllm or hf")
        return hf  # read as HF indices as they are
    return [h - 1 for h in hf]


def sglang_layers_note(layers: AuxLayers, config: Any) -> str:
    """What 04's plan adds to its layers line for the SGLang backend."""
    return (f"; SGLang: two passes, aux layer ids {sglang_layer_ids(layers, config)} "
            "(--return-aux-hidden-state-layer-ids), then the final state after the norm; radix cache off")


def aux_command(params: RunParams, layers: AuxLayers, config: Any, stage: str = "hidden_aux"):
    """The aux pass's server command (also printed by `--print-engine-command`); `stage` names its log
    (`<run>/engine/sglang_<stage>.log`: verify-hidden's recompute launches its own)."""
    ids = [str(x) for x in sglang_layer_ids(layers, config)]
    return sglang_command(params, params.hidden.sglang, stage=stage, radix_cache=False, chunked_prefill=False,
                          extra_args=["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                                      "--return-aux-hidden-state-layer-ids", *ids])


def final_command(params: RunParams, stage: str = "hidden_final"):
    """The final pass's server command (`stage`: as `aux_command`'s)."""
    return sglang_command(params, params.hidden.sglang, stage=stage, radix_cache=False, chunked_prefill=False,
                          extra_args=["--enable-return-hidden-states"])


# ---------------------------------------------------------------------------- one reply


def reply_rows(body: bytes, n: int, width: int) -> Any:
    """A `/generate` reply's prefill block as float32 [n, width]; ResponseError when it is not exactly that."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ResponseError(f"body is not JSON ({e}); {len(body)} bytes") from None
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        raise ResponseError("`meta_info` missing")
    if meta.get("prompt_tokens") != n:
        raise ResponseError(f"meta_info.prompt_tokens {meta.get('prompt_tokens')} for the {n} ids sent")
    if meta.get("cached_tokens"):
        raise ResponseError(f"meta_info.cached_tokens {meta['cached_tokens']}: a radix-cache hit leaves those rows out "
                            "(serve with --disable-radix-cache)")
    hs = meta.get("hidden_states")
    if not isinstance(hs, list) or not hs:
        raise ResponseError("no meta_info.hidden_states (is the server started with --enable-return-hidden-states, or "
                            "--enable-return-aux-hidden-states?)")
    try:
        rows = np.asarray(hs[0], dtype=np.float32)
    except (ValueError, TypeError):
        raise ResponseError("meta_info.hidden_states[0] is not a matrix of numbers") from None
    if rows.shape != (n, width):
        raise ResponseError(f"meta_info.hidden_states[0] has shape {list(rows.shape)}, expected [{n}, {width}] "
                            f"(a server of the other pass? {width} = {'3 aux states' if width % 3 == 0 else 'final'})")
    if not np.isfinite(rows).all():
        raise ResponseError("hidden states hold NaN or inf")
    return rows


class StatesBackend(SGLangBackend):
    """`/generate` with one sample's ids, `max_new_tokens: 1`, `return_hidden_states: true`; the reply's body is
    kept for the engine to decode off the event loop (`reply_rows`)."""

    section = "hidden.sglang"

    def __init__(self, params: RunParams, kind: str, layer_ids: list[int] | None, longest: int = 0):
        super().__init__(params, get_profile(params.profile), None, settings=params.hidden.sglang)
        self.kind, self.layer_ids, self.longest = kind, layer_ids, longest
        self.sampling_params = {"max_new_tokens": 1, "temperature": 0.0}
        self.sampling = {"max_new_tokens": 1, "temperature": 0.0}

    async def preflight(self, client: Any) -> dict[str, Any]:
        """01's checks (health, the params' model), then the pass's server settings from `/get_server_info`: radix
        cache off, chunked prefill off (`chunked_prefill_problem`); aux: aux capture with our layer ids; final: full
        hidden states, no aux capture. Before the first sample: a server that would cut states is refused."""
        out = await super().preflight(client)
        base = str(client.base_url)
        try:
            r = await client.get("/get_server_info")
            info = orjson.loads(r.content) if r.status_code == 200 else None
        except Exception as e:  # noqa: BLE001 - unreachable or not JSON: refused below
            info, r = None, e
        if not isinstance(info, dict):
            raise GenerateError(f"SGLang server {base}: GET /get_server_info did not answer its settings ({r}): 04 "
                                "checks them before it sends a sample")
        aux = bool(info.get("enable_return_aux_hidden_states"))
        want = f"the {self.kind} pass's"
        if not info.get("disable_radix_cache"):
            raise GenerateError(f"SGLang server {base} runs with the radix cache on: a cached prefix leaves its rows out "
                                f"of the hidden states; start {want} server with --disable-radix-cache")
        chunked = chunked_prefill_problem(info, self.longest, self.params.hidden.sglang.concurrency)
        if chunked:
            raise GenerateError(f"SGLang server {base} {chunked}")
        if self.kind == "aux" and (not aux or list(info.get("return_aux_hidden_state_layer_ids") or []) != self.layer_ids):
            raise GenerateError(f"SGLang server {base} captures aux layers "
                                f"{info.get('return_aux_hidden_state_layer_ids') if aux else 'none'}, not {self.layer_ids}: "
                                "start the aux pass's server with --enable-return-aux-hidden-states --speculative-algorithm "
                                f"EAGLE3 --return-aux-hidden-state-layer-ids {' '.join(map(str, self.layer_ids))}")
        if self.kind == "final" and (aux or info.get("return_hidden_states_mode") != "full"):
            raise GenerateError(f"SGLang server {base} does not return the final hidden states (aux capture "
                                f"{'on' if aux else 'off'}, return_hidden_states_mode "
                                f"{info.get('return_hidden_states_mode')!r}): start the final pass's server with "
                                "--enable-return-hidden-states and without aux capture")
        return {**out, "server_version": info.get("version")}

    def build(self, jobs: Sequence[Job]) -> bytes:
        return orjson.dumps({"input_ids": jobs[0].prompt_ids, "return_hidden_states": True,
                             "sampling_params": self.sampling_params})

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]:
        return [record_dict(jobs[0], source=self.source, model=self.params.model.name, profile=self.profile.name,
                            sampling=self.sampling, finish_reason="stop", latency_s=round(latency_s, 4), body=body,
                            usage={"prompt_tokens": len(jobs[0].prompt_ids), "completion_tokens": 0})]


# ---------------------------------------------------------------------------- staging


def staging_dir(params: RunParams) -> Path:
    return hidden_dir(params) / STAGING


def staging_file(folder: Path, key: Any) -> Path:
    return folder / (hashlib.sha1(str(key).encode()).hexdigest()[:24] + ".safetensors")


def write_staged(path: Path, ids: Sequence[int], aux: Any) -> None:
    from safetensors.torch import save_file
    import torch

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({"aux": aux.contiguous(), "token_ids": torch.tensor(list(ids), dtype=torch.int64)}, str(tmp))
    os.replace(tmp, path)


def read_staged(path: Path, ids: Sequence[int], hidden_size: int) -> Any:
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ResponseError(f"staged aux states {path.name} do not read ({type(e).__name__}: {e}): delete it to "
                            "resend the sample to the aux server") from None
    aux, tok = t.get("aux"), t.get("token_ids")
    if aux is None or tok is None or tok.tolist() != list(ids) or tuple(aux.shape) != (len(ids), 3, hidden_size):
        raise ResponseError(f"staged aux states {path.name} are not this sample's (ids or shape differ): delete it")
    return aux


# ---------------------------------------------------------------------------- one pass


class PassEngine(WatchedEngine, Engine):
    """01's engine with one pass's ending: each reply decoded (off the loop), checked, and staged or stored; a
    server 04 launched (`server`) is watched (`liveness.WatchedEngine`)."""

    def __init__(self, params: RunParams, jobs: list[Job], *, kind: str, base_url: str, hidden_size: int,
                 store_dtype: Any, layer_ids: list[int] | None = None, writer: Any = None, progress: bool,
                 server: Any = None):
        s, hp = params.hidden.sglang, params.hidden
        settings = EngineSettings(concurrency=s.concurrency, timeout_s=s.timeout_s, max_retries=s.max_retries,
                                  stop_grace_s=params.generate.stop_grace_s, ledger_interval_s=1.0)
        ledger = {d: DatasetLedger() for d in dict.fromkeys(j.dataset for j in jobs)}
        for j in jobs:
            ledger[j.dataset].planned += 1
        backend = StatesBackend(params, kind, layer_ids, longest=max((len(j.prompt_ids) for j in jobs), default=0))
        super().__init__(backend, jobs, base_url=base_url, settings=settings, ledger=ledger,
                         journal_dir=hidden_dir(params), run_dir=params.run_dir, done_keys=set(), budgets={},
                         progress=False)
        self.server = server
        self.progress = Progress(progress, run_dir=params.run_dir, stage=STAGE)
        self.kind, self.hidden_size, self.store_dtype, self.writer = kind, hidden_size, store_dtype, writer
        self.width = 3 * hidden_size if kind == "aux" else hidden_size
        self.staging = staging_dir(params)
        self.hdir = hidden_dir(params)
        self.total_tokens = sum(len(j.prompt_ids) for j in jobs)
        self.done = self.tokens = 0
        self.failures: list[dict[str, Any]] = []
        self.stored_keys: list[Any] = []

    def _states(self, job: Job, body: bytes) -> Any:
        import torch

        n = len(job.prompt_ids)
        rows = torch.from_numpy(reply_rows(body, n, self.width))
        if self.kind == "aux":
            write_staged(staging_file(self.staging, job.key), job.prompt_ids,
                         rows.view(n, 3, self.hidden_size).to(self.store_dtype))
            return None
        aux = read_staged(staging_file(self.staging, job.key), job.prompt_ids, self.hidden_size)
        return torch.cat([aux, rows.to(self.store_dtype)[:, None]], dim=1)

    async def _send(self, jobs: list[Job]) -> list[dict[str, Any]]:
        recs = await super()._send(jobs)
        out = []
        for job, rec in zip(jobs, recs):
            body = rec.pop("body", None)
            if rec.get("finish_reason") != "error" and body is not None:
                try:
                    rec["states"] = await asyncio.to_thread(self._states, job, body)
                except ResponseError as e:
                    rec = self.backend.error_record(job, str(e))
            out.append(rec)
        return out

    def _commit(self, job: Job, rec: dict[str, Any]) -> None:
        states = rec.pop("states", None)
        if rec.get("finish_reason") == "error" or (self.kind == "final" and states is None):
            self.failures.append({"key": str(job.key), "dataset": job.dataset, "sample_id": job.sample_id,
                                  "turn": job.turn, "pass": self.kind, "error": rec.get("error") or "no states"})
        else:
            if self.kind == "final":
                position, sample = job.prompt
                self.writer.add(sample, position, states)
                self.stored_keys.append(job.key)
            self.done += 1
            self.tokens += len(job.prompt_ids)
        self.ledger[job.dataset].add_record(rec)
        self.new_records += 1

    def write_ledger(self, status: str) -> None:
        """04's own damage assessment (`<hidden>/sglang_<pass>_ledger.json`), never 01's ledger."""
        write_ledger(self.hdir, self.ledger, status, {"stop_reason": self.stop_reason, "failures": self.failures})
        os.replace(self.hdir / "ledger.json", self.hdir / f"sglang_{self.kind}_ledger.json")

    def _show(self, final: bool = False) -> None:
        n = sum(v.planned for v in self.ledger.values())
        line, rate = capture_line(f"extract sglang {self.kind} pass {self.done:,}/{n:,} samples", self.tokens,
                                  self.total_tokens, len(self.failures), self.in_flight_requests,
                                  time.monotonic() - self._t0, final=final, stop_reason=self.stop_reason)
        self.progress.update(line, final=final, figures={
            "samples": n, "extracted": self.done if self.kind == "final" else 0, "staged": self.done,
            "pass": self.kind, "failed": len(self.failures), "tokens": self.tokens,
            "planned_tokens": self.total_tokens, "tokens_per_s": rate})


@contextlib.contextmanager
def _server(params: RunParams, cmd: Any, url: str | None, progress: bool):
    """The pass's server as (URL, the launched server or None): the given URL, or (`launch`) one started for the
    pass and stopped after it (its whole process group, also when it died)."""
    if not params.hidden.sglang.launch:
        yield str(url), None
        return
    with SGLangServer(cmd, progress=progress) as srv:
        yield srv.base_url, srv


def _run_pass(eng: PassEngine, srv: Any, what: str, stored: Any) -> Any:
    """Run one pass's engine; EngineDied when the server 04 launched for it died (`stored()`: samples stored)."""
    try:
        res = run_engine(eng)
    except GenerateError:
        eng.died = server_death(srv) if srv is not None else None
        if eng.died is None:
            raise
        res = None
    if eng.died:
        raise engine_died(srv, eng.died, stored(), sum(v.planned for v in eng.ledger.values()), what)
    return res


def capture_sglang(params: RunParams, todo: list[tuple[int, Any]], writer: Any, stats: dict[str, Any], *,
                   layers: AuxLayers, config: Any, progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Extract `todo` through SGLang in two passes (aux, then final); fill `stats` as the HF loop does; return the
    samples that failed after their retries and the pass ledgers that hold them. A launched server that dies
    under a pass: EngineDied (what was staged or stored is kept)."""
    import torch

    hp, s = params.hidden, params.hidden.sglang
    if state_names(hp.final_state) != (*AUX_NAMES, "post_norm"):
        raise SGLangHiddenError(f"hidden.backend sglang stores the final state after the norm only: hidden.final_state "
                                f"is {hp.final_state!r} (set post_norm, or use hidden.backend vllm or hf)")
    folder = staging_dir(params)
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [Job(smp.dataset, smp.sample_id, [], None, list(smp.input_ids), turn=smp.turn, prompt=(pos, smp))
            for pos, smp in todo]
    wanted = {staging_file(folder, j.key).name for j in jobs}
    for f in folder.glob("*.safetensors*"):  # staged for samples stored since (a stopped run) or not in the mix
        if f.name not in wanted:
            f.unlink(missing_ok=True)
    dtype, hsize = getattr(torch, hp.dtype), stats["hidden_size"]
    t0 = time.perf_counter()
    cpu = 0.0
    aux_jobs = [j for j in jobs if not staging_file(folder, j.key).exists()]
    fails: list[dict[str, Any]] = []
    stop_reason = None
    if aux_jobs:
        with _server(params, aux_command(params, layers, config), s.base_url, progress) as (url, srv):
            eng = PassEngine(params, aux_jobs, kind="aux", base_url=url, hidden_size=hsize, store_dtype=dtype,
                             layer_ids=sglang_layer_ids(layers, config), progress=progress, server=srv)
            res = _run_pass(eng, srv, " (aux pass; staged aux states kept)", lambda: 0)
        cpu += res.cpu_s
        fails += eng.failures
        stop_reason = res.stop_reason
        stats["aux_server"] = url
    final_jobs = [j for j in jobs if staging_file(folder, j.key).exists()] if not stop_reason else []
    stored: list[Any] = []
    if final_jobs:
        with _server(params, final_command(params), s.final_url, progress) as (url, srv):
            eng = PassEngine(params, final_jobs, kind="final", base_url=url, hidden_size=hsize, store_dtype=dtype,
                             writer=writer, progress=progress, server=srv)
            try:
                res = _run_pass(eng, srv, " (final pass)", lambda: len(eng.stored_keys))
            finally:
                writer.flush()  # the shard in progress is written, stopped or not
        cpu += res.cpu_s
        fails += eng.failures
        stop_reason = stop_reason or res.stop_reason
        stored = eng.stored_keys
        stats["server"] = url
    if not stop_reason:
        for key in stored:  # stored and flushed: its staged aux states are no longer needed
            staging_file(folder, key).unlink(missing_ok=True)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    ntok = sum(len(j.prompt_ids) for j in jobs if j.key in set(stored))
    stats.update(extracted=len(stored), tokens=ntok, computed_tokens=ntok, padded_tokens=ntok,
                 shards_written=len(writer.written), failed=len(fails), failures=fails[:50], backend="sglang",
                 engine_cpu_s=round(cpu, 3), staged_aux=len(list(folder.glob("*.safetensors"))))
    if stop_reason:
        stats.update(stopped_early=True, stop_reason=stop_reason)
    hdir = hidden_dir(params)
    return fails, [str(hdir / f"sglang_{k}_ledger.json") for k in ("aux", "final")
                   if any(f.get("pass") == k for f in fails)]
