"""04 through a vLLM server (`hidden.backend: vllm`): the engine computes the states, this client stores them.

The server runs the speculative method `extract_hidden_states` with layer ids `[2, N//2, N-3, N]`
(HF `hidden_states` indices: the profile's three aux layers, then `N`, the last layer's output
before the final norm) and a hidden-states connector: on CPU the project's own
(`vllm_connector/cpu_hidden_states.py`, loaded by the server through `kv_connector_module_path`), on CUDA
vLLM's `ExampleHiddenStatesConnector`. Each mix sample goes as one `/v1/completions` request
(`prompt` = its ids, `max_tokens: 1`, `return_token_ids`); the reply's `prompt_token_ids` must
equal what was sent, and its `kv_transfer_params.hidden_states_path` names a safetensors file
(`hidden_states` [n, 4, H], `token_ids` [n]) written by the engine after the request, guarded by
`<file>.lock` (held exclusively while it is written). The client takes a shared lock on it (polled,
up to `lock_timeout_s`), reads and checks the file (token ids, shape, dtype, finite), keeps the three
aux layers and the pre-norm state, computes the post-norm state as the model's final RMSNorm
applied in fp32 (its weight read from the checkpoint, `final_norm`), hands the sample to the
store's one writer and deletes the engine's files. A sample whose reply or file is wrong fails
alone, with its reason (`<hidden>/vllm_ledger.json`, the result's `failures`); resume sends it again.

The client is 01's HTTP engine (`generate/backends/engine.py`: requests in flight, retries,
Ctrl-C/`STOP`: what is in flight finishes and the shard in progress is written), resume is by
key from the store (`extract.plan_work`), and the mix, plan, index and manifest are the HF path's.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import orjson

from eagle3data.core.params import RunParams
from eagle3data.core.profiles import AuxLayers, get_profile
from eagle3data.core.progress import Progress, capture_line
from eagle3data.core.reader import Sample
from eagle3data.core.models import text_config
from eagle3data.hidden.norms import known_norm_kind, norm_eps, read_final_norm, rms_norm
from eagle3data.generate.backends.engine import Engine, EngineSettings, GenerateError, Job, record_dict
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.generate.backends.vllm import VLLMBackend, completion_choices
from eagle3data.generate.backends.vllm_server import EngineCommand, VLLMServer, model_dir, server_command
from eagle3data.generate.ledger import DatasetLedger, write_ledger
from eagle3data.generate.run import run_engine
from eagle3data.hidden.engines.liveness import WatchedEngine, engine_died, server_death
from eagle3data.hidden.engines.settings import PREFIX_CACHING_OFF, cache_config_info, settings_problem
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import AUX_NAMES, HiddenError, state_names

STAGE = "04_extract_hidden"
CONNECTOR_DIR = Path(__file__).resolve().parent / "vllm_connector"  # on the server's PYTHONPATH: the connector alone
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "cpu_hidden_states")  # class, module (vllm_connector/cpu_hidden_states.py)
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
LOCK_POLL_S = 0.02


def engine_layer_ids(layers: AuxLayers) -> list[int]:
    """The ids the server captures: the three aux HF indices, then N (the last layer's pre-norm output)."""
    return [*layers.hf_indices, layers.num_layers]


def vllm_layers_note(layers: AuxLayers) -> str:
    """What 04's plan adds to its layers line for the vLLM backend."""
    return (f"; vLLM layer ids {engine_layer_ids(layers)} (id {layers.num_layers} = pre_norm; post_norm = the "
            "final norm on it in fp32)")


def files_dir(params: RunParams) -> Path:
    """Where a launched server writes its per-request files."""
    v = params.hidden.vllm
    return Path(v.files_dir) if v.files_dir else hidden_dir(params) / "engine_files"


def hidden_command(params: RunParams, layers: AuxLayers) -> EngineCommand:
    """The exact server command 04 launches (also printed by `--print-engine-command`)."""
    v = params.hidden.vllm
    connector = v.server.connector
    if connector == "auto":
        connector = "cpu" if params.model.device == "cpu" else "stock"
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(layers)}}}
    kv: dict[str, Any] = {"kv_connector": STOCK_CONNECTOR, "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": str(files_dir(params))}}
    if connector == "cpu":
        kv.update(kv_connector=CPU_CONNECTOR[0], kv_connector_module_path=CPU_CONNECTOR[1])
    args = ["--speculative-config", orjson.dumps(spec).decode(), "--kv-transfer-config", orjson.dumps(kv).decode(),
            PREFIX_CACHING_OFF]
    return server_command(params, v, stage="hidden", extra_args=args,
                          extra_env_path=[str(CONNECTOR_DIR)] if connector == "cpu" else None)


# ---------------------------------------------------------------------------- the final norm


# The final norm of a model type (its text config's `model_type`), as transformers 5.24 computes it
# (each RMSNorm's forward, read in transformers' modeling code; tests/test_hidden_vllm.py checks
# the listed ones against transformers' own classes): `x / rms(x)` in fp32 times `weight` ("rms")
# or times `1 + weight` ("rms_1p": Gemma 1-3, Qwen3-Next/3.5). A type not listed, or one whose final
# norm is a LayerNorm, is refused: its post-norm state would be silently wrong.


def norm_kind(config: Any) -> str:
    """The final norm's kind of a model from its config (`NORM_KINDS`), or a HiddenError in one line."""
    text = text_config(config)
    mt = getattr(text, "model_type", None)
    kind = known_norm_kind(config)
    if kind is None:
        raise HiddenError(f"model_type {mt!r}: the kind of its final norm is not known to eagle3data (hidden/norms."
                          "NORM_KINDS), so the post-norm state cannot be computed from vLLM's pre-norm one: set "
                          "hidden.final_state pre_norm, or use hidden.backend hf")
    if norm_eps(config) is None:  # the eps rule of the one norm reader (verify's head reads it the same way)
        raise HiddenError(f"model_type {mt!r}: the config has no rms_norm_eps (nor layer_norm_epsilon): cannot "
                          "compute the post-norm state (set hidden.final_state pre_norm)")
    return kind


def final_norm(params: RunParams, config: Any) -> tuple[Any, float]:
    """(multiplier fp32, eps) of the model's final RMSNorm, read from the checkpoint (no model loaded;
    `norms.read_final_norm`, verify-hidden's reader too): `weight`, or `1 + weight` for the "rms_1p" kind, so that
    `rms_norm(x, *final_norm(...))` is the model's."""
    norm_kind(config)  # a kind and an eps the config states, or a HiddenError
    folder = Path(model_dir(params))
    got = read_final_norm(folder, config)
    if got is None:
        raise HiddenError(f"{folder}: no `model.norm.weight` in the checkpoint (of the text config's hidden size "
                          f"{getattr(text_config(config), 'hidden_size', None)}): cannot compute the post-norm state "
                          "(set hidden.final_state pre_norm)")
    return got.multiplier, float(got.eps)


# ---------------------------------------------------------------------------- one reply's file


async def wait_unlocked(path: str, timeout_s: float) -> None:
    """Wait until the engine's `<path>.lock` can be locked shared (its write is done); raise ResponseError."""
    lock, t0 = path + ".lock", time.monotonic()
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            if os.path.exists(path):
                return  # no lock (a connector without one, or already cleaned): the file is complete
            fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
        if time.monotonic() - t0 > timeout_s:
            state = "still locked" if os.path.exists(lock) else "no file and no lock"
            raise ResponseError(f"hidden states file {path} not ready after {timeout_s:g} s ({state}; "
                                "hidden.vllm.lock_timeout_s)")
        await asyncio.sleep(LOCK_POLL_S)


def read_states(path: str, sent: Sequence[int], hidden_size: int, names: Sequence[str], norm: Any,
                store_dtype: Any) -> Any:
    """The engine's file as the store's states [n, S, H] in `names` order; ResponseError when it is wrong."""
    import torch
    from safetensors.torch import load_file

    try:
        data = load_file(path, device="cpu")
    except FileNotFoundError:
        raise ResponseError(f"hidden states file {path} is gone (lost before it was read)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ResponseError(f"hidden states file {path} does not read: {type(e).__name__}: {e}") from None
    hs, ids = data.get("hidden_states"), data.get("token_ids")
    n = len(sent)
    if hs is None:
        raise ResponseError(f"{path}: no `hidden_states` tensor (has {sorted(data)})")
    if ids is not None and ids.tolist() != list(sent):
        raise ResponseError(f"{path}: its token_ids ({ids.numel()}) differ from the {n} ids sent")
    if tuple(hs.shape) != (n, len(AUX_NAMES) + 1, hidden_size):
        raise ResponseError(f"{path}: hidden_states shape {tuple(hs.shape)}, expected ({n}, 4, {hidden_size})")
    if not hs.is_floating_point():
        raise ResponseError(f"{path}: hidden_states dtype {hs.dtype} is not a float")
    if not bool(torch.isfinite(hs).all()):
        raise ResponseError(f"{path}: hidden_states hold NaN or inf")
    finals = {"pre_norm": hs[:, 3], "post_norm": None}
    if "post_norm" in names:
        finals["post_norm"] = rms_norm(hs[:, 3], *norm)
    parts = [hs[:, i] for i in range(len(AUX_NAMES))] + [finals[x] for x in names[len(AUX_NAMES):]]
    return torch.stack([p.to(store_dtype) for p in parts], dim=1)


def remove_engine_files(path: str) -> None:
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


# ---------------------------------------------------------------------------- the server of one 04 run


class ServerLease:
    """The vLLM server one 04 run talks to: `hidden.vllm.base_url`, or (`launch`) one started on first use
    and stopped by `close()`, so that the capture and the verify's recompute use the same server."""

    def __init__(self, params: RunParams, progress: bool = True):
        self.params, self.progress = params, progress
        self.server: VLLMServer | None = None

    def base_url(self, layers: AuxLayers) -> str:
        v = self.params.hidden.vllm
        if not v.launch:
            return str(v.base_url)
        if self.server is None:
            files_dir(self.params).mkdir(parents=True, exist_ok=True)
            self.server = VLLMServer(hidden_command(self.params, layers), progress=self.progress).start()
        return self.server.base_url

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()


_LEASES: dict[str, ServerLease] = {}  # a run's hidden folder -> the lease of its run_extract in progress


@contextlib.contextmanager
def vllm_session(params: RunParams, progress: bool = True):
    """Around one `run_extract`: a launched server lives through the capture and the verify, then stops
    (an error or Ctrl-C too); for `hidden.backend: hf` nothing."""
    if params.hidden.backend != "vllm":
        yield None
        return
    key, lease = str(hidden_dir(params)), ServerLease(params, progress)
    _LEASES[key] = lease
    try:
        yield lease
    finally:
        _LEASES.pop(key, None)
        lease.close()


def holds_vllm_server(run_extract: Callable[..., Any]) -> Callable[..., Any]:
    """`run_extract` inside `vllm_session`: what it launches is stopped when it returns or raises."""

    @functools.wraps(run_extract)
    def run(params: RunParams, progress: bool = True, **kw: Any) -> Any:
        with vllm_session(params, progress):
            return run_extract(params, progress, **kw)

    return run


@contextlib.contextmanager
def run_lease(params: RunParams, progress: bool = True):
    """The lease of the 04 run in progress for these params (not closed here), else one of its own (closed)."""
    lease = _LEASES.get(str(hidden_dir(params)))
    if lease is not None:
        yield lease
        return
    lease = ServerLease(params, progress)
    try:
        yield lease
    finally:
        lease.close()


# ---------------------------------------------------------------------------- requests and the engine


class HiddenBackend(VLLMBackend):
    """`/v1/completions` with a sample's ids, `max_tokens: 1`; a reply -> (echo checked) its file's path."""

    source = "vllm"
    section = "hidden.vllm"

    def __init__(self, params: RunParams, *, longest: int = 0, launched: bool = False):
        super().__init__(params, get_profile(params.profile), None, settings=params.hidden.vllm)
        self.base = {"max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        self.sampling = {"max_new_tokens": 1, "temperature": 0.0}
        self.longest, self.launched = longest, launched

    async def preflight(self, client: Any) -> dict[str, Any]:
        """01's checks (the server lists the params' model), then what would cut or alter the states, before the
        first sample: a context shorter than the mix's longest sample, and prefix caching on (`/metrics`' cache
        config, `settings_problem`). A server that does not publish its cache config is taken on the file checks
        alone (each file must hold one row per id sent) unless 04 launched it."""
        out = await super().preflight(client)
        base = str(client.base_url)
        try:
            r = await client.get(str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics")
            text = r.text if r.status_code == 200 else ""
        except Exception:  # noqa: BLE001 - no metrics: judged below
            text = ""
        cache = cache_config_info(text)
        why = settings_problem(cache, out.get("server_max_model_len"), self.longest, launched=self.launched)
        if why:
            raise GenerateError(f"vLLM server {base}: {why}")
        return {**out, "server_prefix_caching": None if cache is None else cache.get("enable_prefix_caching")}

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]:
        obj, choices = completion_choices(body, 1)
        job, choice = jobs[0], choices[0]
        echoed = choice.get("prompt_token_ids")
        if echoed != job.prompt_ids:
            raise ResponseError("no `prompt_token_ids` echoed (return_token_ids)" if echoed is None else
                                f"echoed prompt_token_ids ({len(echoed)} ids) differ from the {len(job.prompt_ids)} "
                                "ids sent: the server ran another sequence")
        kv = obj.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}
        path = kv.get("hidden_states_path") if isinstance(kv, dict) else None
        if not isinstance(path, str) or not path:
            raise ResponseError("no kv_transfer_params.hidden_states_path in the reply (is the server running "
                                "extract_hidden_states with a hidden-states connector?)")
        return [record_dict(job, source=self.source, model=self.params.model.name, profile=self.profile.name,
                            sampling=self.sampling, finish_reason="stop", latency_s=round(latency_s, 4),
                            hidden_states_path=path, usage={"prompt_tokens": len(job.prompt_ids),
                                                            "completion_tokens": 0})]


class HiddenEngine(WatchedEngine, Engine):
    """01's engine with 04's ending: each reply's file read after its lock, checked, and given to the writer; a
    server 04 launched (`server`) is watched (`liveness.WatchedEngine`)."""

    def __init__(self, params: RunParams, jobs: list[Job], *, base_url: str, writer: Any, hidden_size: int,
                 norm: Any, done_keys: set, progress: bool, server: Any = None):
        v, hp = params.hidden.vllm, params.hidden
        settings = EngineSettings(concurrency=v.concurrency, timeout_s=v.timeout_s, max_retries=v.max_retries,
                                  stop_grace_s=params.generate.stop_grace_s, ledger_interval_s=1.0)
        ledger = {d: DatasetLedger() for d in dict.fromkeys(j.dataset for j in jobs)}
        for j in jobs:
            ledger[j.dataset].planned += 1
        backend = HiddenBackend(params, longest=max((len(j.prompt_ids) for j in jobs), default=0),
                                launched=server is not None)
        super().__init__(backend, jobs, base_url=base_url, settings=settings, ledger=ledger,
                         journal_dir=hidden_dir(params), run_dir=params.run_dir, done_keys=done_keys,
                         budgets={}, progress=False)  # 04's own line below, not 01's
        import torch

        self.server = server

        self.progress = Progress(progress, run_dir=params.run_dir, stage=STAGE)
        self.hdir = hidden_dir(params)
        self.writer, self.hidden_size, self.norm = writer, hidden_size, norm
        self.names = state_names(hp.final_state)
        self.store_dtype = getattr(torch, hp.dtype)
        self.lock_timeout_s = v.lock_timeout_s
        self.total_tokens = sum(len(j.prompt_ids) for j in jobs)
        self.extracted = self.tokens = 0
        self.failures: list[dict[str, Any]] = []

    async def _send(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """The request with its retries, then (a good reply) its file: read, checked, turned into states."""
        recs = await super()._send(jobs)
        out = []
        for job, rec in zip(jobs, recs):
            path = rec.pop("hidden_states_path", None)
            if rec.get("finish_reason") != "error" and path:
                try:
                    await wait_unlocked(path, self.lock_timeout_s)
                    rec["states"] = await asyncio.to_thread(read_states, path, job.prompt_ids, self.hidden_size,
                                                            self.names, self.norm, self.store_dtype)
                except ResponseError as e:
                    rec = self.backend.error_record(job, str(e))
                finally:
                    remove_engine_files(path)
            out.append(rec)
        return out

    def _commit(self, job: Job, rec: dict[str, Any]) -> None:
        key = job.key
        if key in self.done_keys:
            self.duplicates += 1
            return
        states = rec.pop("states", None)
        if rec.get("finish_reason") == "error" or states is None:
            self.failures.append({"key": str(key), "dataset": job.dataset, "sample_id": job.sample_id,
                                  "turn": job.turn, "error": rec.get("error") or "no states"})
        else:
            position, sample = job.prompt
            self.writer.add(sample, position, states)
            self.done_keys.add(key)
            self.extracted += 1
            self.tokens += len(sample.input_ids)
        self.ledger[job.dataset].add_record(rec)
        self.new_records += 1

    def write_ledger(self, status: str) -> None:
        """04's own damage assessment (`<hidden>/vllm_ledger.json`), never 01's ledger."""
        write_ledger(self.hdir, self.ledger, status, {"stop_reason": self.stop_reason, "failures": self.failures})
        os.replace(self.hdir / "ledger.json", self.hdir / "vllm_ledger.json")

    def _show(self, final: bool = False) -> None:
        n = sum(v.planned for v in self.ledger.values())
        line, rate = capture_line(f"extract vllm {self.extracted:,}/{n:,} samples", self.tokens, self.total_tokens,
                                  len(self.failures), self.in_flight_requests, time.monotonic() - self._t0,
                                  final=final, stop_reason=self.stop_reason)
        self.progress.update(line, final=final, figures={
            "samples": n, "extracted": self.extracted, "failed": len(self.failures), "tokens": self.tokens,
            "planned_tokens": self.total_tokens, "tokens_per_s": rate})


def capture_vllm(params: RunParams, todo: list[tuple[int, Sample]], writer: Any, stats: dict[str, Any], *,
                 layers: AuxLayers, config: Any, progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Extract `todo` through a vLLM server (started here with `launch`); fill `stats` as the HF loop does; return
    the samples that failed after their retries and the ledger that holds them. A launched server that dies under
    the capture: EngineDied (what came back is stored)."""
    hp = params.hidden
    norm = final_norm(params, config) if "post_norm" in state_names(hp.final_state) else None
    jobs = [Job(s.dataset, s.sample_id, [], None, list(s.input_ids), turn=s.turn, prompt=(pos, s)) for pos, s in todo]
    with run_lease(params, progress) as lease:
        base_url = lease.base_url(layers)
        engine = HiddenEngine(params, jobs, base_url=base_url, writer=writer, hidden_size=stats["hidden_size"],
                              norm=norm, done_keys=set(), progress=progress, server=lease.server)

        t0 = time.perf_counter()
        try:
            res = run_engine(engine)
        except GenerateError:
            why = server_death(lease.server) if lease.server is not None else None
            if why is None:
                raise
            engine.died = why  # it died before the first sample (its preflight found no server)
        finally:
            writer.flush()  # the shard in progress is written, stopped or not
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        if engine.died:
            raise engine_died(lease.server, engine.died, engine.extracted, len(jobs))
    stats.update(extracted=engine.extracted, tokens=engine.tokens, computed_tokens=engine.tokens,
                 padded_tokens=engine.tokens, shards_written=len(writer.written), failed=len(engine.failures),
                 failures=engine.failures[:50], backend="vllm", engine_cpu_s=round(res.cpu_s, 3),
                 server=base_url)
    if res.stop_reason:
        stats.update(stopped_early=True, stop_reason=res.stop_reason)
    return engine.failures, [str(hidden_dir(params) / "vllm_ledger.json")]
