"""06's `online` variant: the draft trained on 05's `export/speculators_online/` (ids and masks, no states), with
the target's states computed **while it trains** by a vLLM server the stage starts, through speculators' own online
path; the loop is 06's own (`train.train_draft`).

What is whose (speculators 0.9.0, hs-connectors 0.9.0, read in their installed sources):
- **speculators'**: the dataset (`train.data.ArrowDataset` with `on_missing="generate"`: a row with no
  `hidden_states/hs_<i>.safetensors` is sent to `vllm_endpoint` by `data_generation.vllm_client.
  generate_hidden_states`: `/v1/completions`, `prompt` = the row's ids, `max_tokens: 1`, `return_token_ids`;
  `extract_output` refuses a reply whose echoed `prompt_token_ids` differ from the ids sent), its checks of the
  file (`check_hidden_states`: token ids, length, finite), its retry guard (`GenerationRecoveryGuard`), and
  `_setup_client`'s check that the server serves the verifier asked for;
- **hs-connectors'**: the file backend (`HiddenStatesBackend.registry["file"]`, `FileTransfer`: the file named by
  the reply's `kv_transfer_params.hidden_states_path` read after its `.lock`, then deleted), built as `speculators
  train` builds it (`from_train_args`);
- **the server**: 04's own command (`engines.vllm_capture.hidden_command`: `extract_hidden_states` at the store's
  HF indices plus N, the last layer's pre-norm output, which speculators' draft normalizes itself). On vLLM's CPU
  build it loads the project's connector (`vllm_connector/cpu_hidden_states.py`, `hidden.vllm.server.connector`
  auto = cpu for `model.device: cpu`): vLLM's stock `ExampleHiddenStatesConnector` copies each request's states on
  a `torch.cuda.Stream` into `pin_memory=True` buffers and waits on CUDA events, which kills the CPU engine and
  leaves an empty `.lock`. On CUDA the stock one (`connector: auto` = stock).
- **ours**: `OnlineStates`, speculators' `ArrowDataset` with a tally around its own round trip (each request, each
  reply that passed its echoed-ids check, each failure) and, where the run has 04's store, every generated row's
  states compared with the store's for the same key with verify-hidden's recompute comparison (`compare_states`,
  `recompute_failed`: the store dtype's tolerance, an 8-bit store's own error bound added) and its ids with the
  store's ids. One line per round trip in `value/online/online_states.jsonl`; `result.json`'s `online` sums them.
  A row that speculators gives up on (`SampleUnavailable`) stops training (`train_draft`): no silent drop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from eagle3data.core.params import RunParams
from eagle3data.core.params.hidden import HiddenVLLMParams
from eagle3data.core.peer_logs import PEER_LOG, peers_to_log
from eagle3data.generate.backends.vllm_server import EngineCommand, VLLMServer
from eagle3data.hidden.capture import layer_plan, load_config
from eagle3data.hidden.engines.vllm_capture import engine_layer_ids, final_norm, hidden_command
from eagle3data.hidden.norms import rms_norm
from eagle3data.hidden.store.format import AUX_NAMES, INFO_FILE
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.hidden.verify.checks import compare_states, recompute_failed
from eagle3data.hidden.verify.run import compute_dtype
from eagle3data.value.train import (CHECKPOINT, TrainConfig, TrainResult, ValueStageError, train_draft,
                                    training_identity)

ONLINE_HANDOFF = Path("export") / "speculators_online"
LEDGER = "online_states.jsonl"
FILES = "engine_files"


def online_handoff(run_dir: Path) -> Path:
    """05's online hand-off of the run, checked to be one: its manifest with the rows' keys, speculators' dataset
    folder, the draft vocabulary, and no stored states (a `hidden_states/hs_<i>` file would be read instead of
    generated)."""
    h = Path(run_dir) / ONLINE_HANDOFF
    info = h / "handoff.json"
    if not info.exists():
        raise ValueStageError(f"{info}: no online hand-off (run 05 with export.formats including speculators_online)")
    keys = json.loads(info.read_text(encoding="utf-8")).get("keys")
    if not keys:
        raise ValueStageError(f"{info}: field keys: the rows' sample keys are missing (06 trains in exact's row order)")
    if not (h / "dataset_info.json").exists() and not (h / "state.json").exists():
        raise ValueStageError(f"{h}: not a datasets save_to_disk folder (speculators' --data-path)")
    if not any(h.glob("d2t-*.npy")):
        raise ValueStageError(f"{h}: no d2t-<N>.npy (05's draft vocabulary)")
    stored = list((h / "hidden_states").glob("hs_*.safetensors")) if (h / "hidden_states").is_dir() else []
    if stored:
        raise ValueStageError(f"{h / 'hidden_states'}: {len(stored)} stored state files: speculators would read them "
                              "instead of asking the server (not an online hand-off)")
    return h


def handoff_fingerprint(handoff: Path) -> str:
    """What 06's kept result of the variant depends on: the online hand-off's manifest."""
    return hashlib.blake2b((Path(handoff) / "handoff.json").read_bytes(), digest_size=8).hexdigest()


def states_server_params(params: RunParams, files: Path) -> RunParams:
    """The run's params with 04's vLLM section for the states server 06 launches: the run's own `hidden.vllm.server`
    when 04 ran through vLLM, else `value.eval.server` (the engine 06 evaluates with); its files in `files`."""
    v = params.hidden.vllm
    server = v.server if v is not None else params.value.eval.server
    hv = HiddenVLLMParams(launch=True, server=server, files_dir=str(files))
    return params.model_copy(update={"hidden": params.hidden.model_copy(update={"backend": "vllm", "vllm": hv})})


def states_server_command(params: RunParams, files: Path) -> EngineCommand:
    """04's exact server command (extract_hidden_states at the profile's layers + N, the connector for the device),
    writing its per-request files into `files`, its log as `engine/vllm_06_online_states.log`."""
    sp = states_server_params(params, files)
    cmd = hidden_command(sp, layer_plan(sp, load_config(sp)))
    return dataclasses.replace(cmd, log=params.run_dir / "engine" / "vllm_06_online_states.log")


class StoreCheck:
    """04's store of the run, to compare generated states with (`compare`): the states in the store's own order
    (three aux layers, then the final state(s): pre-norm as the engine gives it, post-norm as 04 computes it)."""

    def __init__(self, params: RunParams):
        self.reader = HiddenReader(params.run_dir / "hidden")
        self.names = list(self.reader.states)
        self.dtype = str(self.reader.info.get("dtype", "bfloat16"))
        self.compute = compute_dtype(params)
        self.norm = final_norm(params, load_config(params)) if "post_norm" in self.names else None

    def compare(self, key: str, ids: Sequence[int], hs: Any) -> dict[str, Any]:
        """One generated row (`hs` [n, 4, hidden]: aux layers, then id N) against the store's sample of `key`."""
        if self.reader.row(key) is None:
            return {"checked": False, "why": "not in 04's store"}
        stored = self.reader.sample(key)
        ids_equal = [int(x) for x in stored["input_ids"].tolist()] == list(ids)
        if not ids_equal:
            return {"checked": True, "ids_equal": False, "ok": False}
        finals = {"pre_norm": hs[:, len(AUX_NAMES)],
                  "post_norm": rms_norm(hs[:, len(AUX_NAMES)], *self.norm) if self.norm is not None else None}
        ref = torch.stack([hs[:, i].float() for i in range(len(AUX_NAMES))]
                          + [finals[x].float() for x in self.names[len(AUX_NAMES):]], dim=1)
        # an 8-bit store differs from what was captured by its own step too (verify-hidden adds the same bound)
        codec = self.reader.codec
        bound = codec.error_bound(self.reader.sample(key, raw=True)) if codec.quantized else None
        cmp = compare_states(stored["hidden_states"], ref, self.names, self.dtype, bound, self.compute)
        return {"checked": True, "ids_equal": True, "ok": not recompute_failed(cmp), "layers": cmp}


_DATASET: Any = None


def online_dataset_class() -> Any:
    """`OnlineStates`: speculators' ArrowDataset (imported on first use: speculators loads its model stack)."""
    global _DATASET
    if _DATASET is not None:
        return _DATASET
    from speculators.data_generation.vllm_client import InvalidResponseError
    from speculators.train.data import ArrowDataset

    class OnlineStates(ArrowDataset):
        """speculators' dataset generating every row's states (`on_missing="generate"`) through hs-connectors' file
        backend, with a tally of its round trips in `ledger` (one JSON line each) and the store comparison."""

        def __init__(self, handoff: Path, *, max_len: int, endpoint: str, model: str, keys: Sequence[str],
                     ledger: Path, identity: str, check: StoreCheck | None = None, **kw: Any):
            from hs_connectors import HiddenStatesBackend

            # as `speculators train --hidden-states-backend file` builds it (no --hidden-states-path given:
            # <data>/hidden_states, where an online hand-off holds nothing)
            transfer = HiddenStatesBackend.registry["file"].from_train_args(
                SimpleNamespace(hidden_states_path=None), str(handoff))
            super().__init__(max_len=max_len, datapath=str(handoff), transfer=transfer, vllm_endpoint=endpoint,
                             on_missing="generate", hidden_states_dtype=torch.float32, model=model, **kw)
            self.keys, self.ledger, self.identity, self.check = [str(k) for k in keys], ledger, identity, check
            self._index: int | None = None
            self.last_error: str | None = None

        def _get_raw_data(self, index: int) -> Any:
            self._index = index
            return super()._get_raw_data(index)

        def _log(self, line: dict[str, Any]) -> None:
            with open(self.ledger, "a", encoding="utf-8") as f:
                f.write(json.dumps({"identity": self.identity} | line) + "\n")

        def _generate_hidden_states_once(self, dataset_item: dict, client_item: Any) -> Any:
            i = self._index
            key = self.keys[i] if i is not None and i < len(self.keys) else None
            t0 = time.monotonic()
            try:
                # speculators' round trip: the request, extract_output's echoed-ids check, the file read after its
                # lock, check_hidden_states, the file deleted
                hs = super()._generate_hidden_states_once(dataset_item, client_item)
            except Exception as e:
                self.last_error = f"row {i} ({key}): {type(e).__name__}: {str(e)[:300]}"
                mismatch = isinstance(e, InvalidResponseError) and "mismatch" in str(e)
                self._log({"row": i, "key": key, "ok": False, "echo_mismatch": mismatch,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"})
                raise
            ids = [int(x) for x in client_item["input_ids"]]
            line: dict[str, Any] = {"row": i, "key": key, "ok": True, "tokens": len(ids), "echoed_ids_equal": True,
                                    "seconds": round(time.monotonic() - t0, 4)}
            if self.check is not None and key is not None:
                line["store"] = self.check.compare(key, ids, hs["hidden_states"])
            self._log(line)
            return hs

    _DATASET = OnlineStates
    return OnlineStates


def _tally(ledger: Path, identity: str) -> dict[str, Any]:
    """The ledger's round trips of this training as the result's figures."""
    lines = [json.loads(x) for x in ledger.read_text(encoding="utf-8").splitlines() if x.strip()] \
        if ledger.exists() else []
    lines = [x for x in lines if x.get("identity") == identity]
    ok = [x for x in lines if x.get("ok")]
    checked = [x["store"] for x in ok if (x.get("store") or {}).get("checked")]
    worst: dict[str, float] = {}
    for c in checked:
        for nm, f in (c.get("layers") or {}).items():
            worst[nm] = max(worst.get(nm, 0.0), float(f["max_rel"]))
    return {"requests": len(lines), "rows_generated": len({x["key"] for x in ok}),
            "tokens": sum(x["tokens"] for x in ok),
            "echoed_ids_equal": len(ok), "echo_mismatches": sum(bool(x.get("echo_mismatch")) for x in lines),
            "failed_requests": len(lines) - len(ok), "generate_s": round(sum(x["seconds"] for x in ok), 1),
            "store_check": {"rows": len(checked), "ids_equal": sum(bool(c.get("ids_equal")) for c in checked),
                            "failed": sum(not c.get("ok") for c in checked),
                            "failed_keys": [x["key"] for x in ok if (x.get("store") or {}).get("ok") is False][:10],
                            "worst_max_rel": {k: round(v, 6) for k, v in worst.items()}}}


def train_online(params: RunParams, handoff: Path, model_dir: Path, layer_ids: Sequence[int], out_dir: Path,
                 cfg: TrainConfig, rows: Sequence[int], *, say: Callable[[str], None] = print,
                 stop: Callable[[], bool] | None = None, endpoint: str | None = None,
                 client: dict[str, Any] | None = None) -> tuple[TrainResult, dict[str, Any]]:
    """Train the draft on the online hand-off's `rows` with states generated as it trains: a states server is
    started for it (04's command) and stopped after, or `endpoint` (a server already running, its files readable
    here) is used. `client`: more of ArrowDataset's settings (request_timeout, max_retries, ...).

    Returns the training's figures and the `online` figures: the server, the tally of the round trips (every reply's
    echoed ids checked by speculators), the store comparison."""
    out_dir.mkdir(parents=True, exist_ok=True)
    identity = training_identity(handoff, rows, cfg)
    ledger = out_dir / LEDGER
    if not (out_dir / CHECKPOINT).exists():  # a fresh training: the round trips of an earlier one are not its
        ledger.write_text("", encoding="utf-8")
    keys = [str(k) for k in json.loads((handoff / "handoff.json").read_text(encoding="utf-8"))["keys"]]
    check = StoreCheck(params) if (params.run_dir / "hidden" / INFO_FILE).exists() else None
    if check is not None and list(check.reader.info.get("hf_indices") or []) != list(layer_ids):
        raise ValueStageError(f"{params.run_dir / 'hidden' / INFO_FILE}: the store's layers "
                              f"{check.reader.info.get('hf_indices')} are not the draft's {list(layer_ids)}")
    files = out_dir / FILES
    files.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"handoff": str(handoff)}
    cmd = None
    if endpoint is None:
        cmd = states_server_command(params, files)
        layers = layer_plan(params, load_config(params))
        if list(layers.hf_indices) != list(layer_ids):
            raise ValueStageError(f"the profile's layers {list(layers.hf_indices)} are not the store's "
                                  f"{list(layer_ids)}")
        info["server"] = {"command": cmd.shell(), "layer_ids": engine_layer_ids(layers),
                          "connector": json.loads(cmd.argv[cmd.argv.index("--kv-transfer-config") + 1])["kv_connector"]}
    t0 = time.monotonic()

    def train(url: str) -> TrainResult:
        with peers_to_log(out_dir / PEER_LOG):  # speculators' client and hs-connectors' lines too, not the notebook's
            ds = online_dataset_class()(handoff, max_len=cfg.total_seq_len, endpoint=url, model=params.model.name,
                                        keys=keys, ledger=ledger, identity=identity, check=check, **(client or {}))
            return train_draft(handoff, model_dir, layer_ids, out_dir, cfg, rows, say=say, stop=stop, dataset=ds)

    if cmd is not None:
        say(f"online: starting the states server ({info['server']['connector']}, layers {info['server']['layer_ids']})")
        with VLLMServer(cmd, progress=False) as srv:
            info["server"]["start_s"] = srv.started_s
            tr = train(srv.base_url)
    else:
        info["server"] = {"base_url": endpoint}
        tr = train(endpoint)
    info["seconds"] = round(time.monotonic() - t0, 1)
    info |= _tally(ledger, identity)
    info["files_left"] = sum(1 for _ in files.iterdir())  # speculators deletes each file it read
    st = info["store_check"]
    say(f"online: {info['rows_generated']:,} rows generated ({info['requests']:,} requests), "
        f"{info['echoed_ids_equal']:,} with echoed ids equal to the row's, {info['failed_requests']} failed; "
        + (f"states vs 04's store: {st['rows']:,} rows, {st['failed']} beyond verify-hidden's tolerance"
           if check is not None else "no 04 store to compare with"))
    return tr, info
