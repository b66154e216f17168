"""05's online hand-offs: the mix's exact ids and loss masks for trainers that compute the states while they train.

No hidden states go out and no 04 store is needed (`hidden.enabled: false` runs 01–03 and these):
the trainer asks a serving engine for each row's states with the row's own ids.

- `speculators_online/` (speculators 0.9.0): the `datasets` folder `speculators train --data-path`
  reads (`ArrowDataset`: `data-*.arrow` with `input_ids`, `loss_mask`, `seq_len`), made by
  speculators' own `prepare-data` machinery on our pre-tokenized rows
  (`speculators.data_generation.preprocessing.build_speculator_training_dataset`, whose
  `_passthrough_pretokenized` keeps rows with `input_ids` and `loss_mask` as they are, cut to
  `--seq-length`, dropping a row with nothing supervised), a chunk of rows at a time, and saved in the
  layout `prepare-data`'s `save_to_disk` writes (datasets' own ArrowWriter, a file per 500 MB, through
  `trainers.speculators.DatasetShards`, the offline hand-off's writer too); called
  directly rather than through `load_and_preprocess_dataset`, which shuffles, so that row i is mix
  row i (the trainer shuffles itself). No `hidden_states/`: with `--on-missing generate` its loader
  posts each row's ids to the vLLM server (`/v1/completions`, `max_tokens: 1`, `return_token_ids`),
  refuses a reply whose echoed ids differ, reads the file the server's connector wrote and deletes it.
  `handoff.json` holds that server's exact command (`extract_hidden_states` with the store's layer
  plan, the hidden-states connector and its shared path) and the training command.
- `specforge_online/` (SpecForge 0.2.0): `prompts.jsonl` for `data.prompts_path` (`{"id", "input_ids",
  "loss_mask"}`: `data/prompt_builder.py::prepare_prompt_tasks` reads a file whose first record has
  both keys as pre-tokenized, `_prompt_from_record` cuts to `data.max_length` and drops a row under
  the minimum loss tokens, 1 for EAGLE-3) and `specforge.yaml` for its online mode (disaggregated,
  Mooncake, one managed capture server on this node; relative paths, as the offline config), with
  the patched SGLang capture server's flags in `handoff.json`.

Rows the trainers would cut or drop at `export.online_max_length` are counted here, before training
(`window`), with the same rule as theirs; both folders also hold `conversations.jsonl`, the rows as
text for trainers that take only text, with `text_drift`'s count in the manifest.

The files that hold rows (`Rows`) are written as the rows go by, `export.chunk_rows` at a time, each
through a temp name renamed when complete: memory is a chunk, not the run, and a run killed midway
leaves no partial file under its name (the next run removes or overwrites the temp files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import orjson

from eagle3data.core.atomic import umask_mode, write_atomic
from eagle3data.core.errors import UserInputError
from eagle3data.core.params.export import ONLINE_FORMATS
from eagle3data.core.params.hidden import HiddenVLLMParams
from eagle3data.core.profiles import AuxLayers, get_profile
from eagle3data.export.handoff import _model_dir
from eagle3data.generate.backends.vllm_server import model_dir
from eagle3data.hidden import capture
from eagle3data.hidden.engines.vllm_capture import engine_layer_ids, files_dir, hidden_command
from eagle3data.export.rows import chunks_of, keys_of, lengths_of
from eagle3data.hidden.mix import hidden_dir
from eagle3data.hidden.store.format import INFO_FILE
from eagle3data.trainers.specforge import VOCAB_FILE, save_vocab_mapping, write_config
from eagle3data.trainers.speculators import DatasetShards, Speculators, rows_dataset

HANDOFF = "handoff.json"
PROMPTS_FILE = "prompts.jsonl"
SPECULATORS_MADE_BY = ("speculators.data_generation.preprocessing.build_speculator_training_dataset "
                       "(_passthrough_pretokenized), saved with datasets save_to_disk as `speculators prepare-data` does")
FALLBACK_MADE_BY = ("eagle3data: speculators is not installed here; the same rule (cut to max_length, drop a row with "
                    "nothing supervised), datasets save_to_disk in the layout ArrowDataset reads")
SPECULATORS_SEQ = 8192  # speculators train's default --total-seq-len (a batch's token budget): kept unless a row is longer
CAPTURE_PORT, CAPTURE_HEADROOM = 30000, 7  # SpecForge: SGLANG_CAPTURE_CONTEXT_HEADROOM (max_length + 7 context)


class OnlineExportError(UserInputError):
    """An online hand-off cannot be written as asked; the message says why."""


# ---------------------------------------------------------------- rows and the trainers' window


def window(samples: Any, max_length: int | None) -> dict[str, Any]:
    """What the trainers do to the rows at `max_length` (None: the longest row): the rows they keep, those they cut
    (longer, something supervised left), those they drop (nothing supervised within the window).

    Both peers' rule: `input_ids[:L]`, `loss_mask[:L]`, dropped when the mask then sums to 0 (speculators
    `_append_row`; SpecForge `_prompt_from_record` with EAGLE-3's minimum of 1 loss token). `Window`, a chunk at a time."""
    w = Window(max_length, max(lengths_of(samples), default=1))
    for chunk in chunks_of(samples):
        w.add(chunk)
    return w.result()


class Window:
    """`window` over rows given a chunk at a time (`add`, in order); `longest`: the longest row's length."""

    def __init__(self, max_length: int | None, longest: int) -> None:
        self.longest, self.L, self.n = longest, int(max_length or longest), 0
        self.kept: list[int] = []
        self.truncated: list[dict[str, Any]] = []
        self.dropped: list[dict[str, Any]] = []

    def add(self, samples: Sequence[Any]) -> None:
        L = self.L
        for i, s in enumerate(samples, start=self.n):
            if sum(s.loss_mask[:L]) == 0:
                self.dropped.append({"key": str(s.key), "length": len(s.input_ids), "supervised": int(sum(s.loss_mask)),
                                     "reason": "nothing supervised" + (f" in the first {L} tokens" if sum(s.loss_mask)
                                                                       else "")})
                continue
            self.kept.append(i)
            if len(s.input_ids) > L:
                self.truncated.append({"key": str(s.key), "length": len(s.input_ids), "kept_tokens": L})
        self.n += len(samples)

    def result(self) -> dict[str, Any]:
        return {"max_length": self.L, "longest_row": self.longest, "rows_in": self.n, "rows_out": len(self.kept),
                "truncated": self.truncated, "dropped": self.dropped, "kept": self.kept}


def window_line(fmt: str, w: dict[str, Any]) -> str:
    """The printed line: what the trainer will cut or drop, before it trains."""
    if not w["truncated"] and not w["dropped"]:
        return f"{fmt}: all {w['rows_in']} rows go to the trainer whole (max_length {w['max_length']})"
    first = ", ".join(x["key"] for x in (w["dropped"] + w["truncated"])[:3])
    return (f"{fmt}: at max_length {w['max_length']} the trainer will TRUNCATE {len(w['truncated'])} and DROP "
            f"{len(w['dropped'])} of {w['rows_in']} rows (first: {first}; export.online_max_length, manifest window)")


# ---------------------------------------------------------------- the layer plan and the servers


def layer_plan(params: Any) -> tuple[AuxLayers, str]:
    """The aux layers the trainers' engine captures: 04's store's recorded plan when there is one (`hidden/index.json`
    `hf_indices`), else the profile's rule on the model's layer count (its config), else on the profile's own."""

    info_path = hidden_dir(params) / INFO_FILE
    if info_path.exists():
        info = orjson.loads(info_path.read_bytes())
        hf = [int(i) for i in info.get("hf_indices") or []]
        if len(hf) == 3 and info.get("num_layers"):
            return AuxLayers(int(info["num_layers"]), tuple(hf), tuple(i - 1 for i in hf)), f"04's store ({info_path})"

    try:
        return capture.layer_plan(params, capture.load_config(params)), "the model's config (no 04 store)"
    except (OSError, ValueError):  # the model folder is on the GPU machine only
        return get_profile(params.profile).aux_layers(), f"profile {params.profile!r} (model config not readable here)"


def states_server(params: Any, layers: AuxLayers) -> dict[str, Any]:
    """The vLLM server speculators asks for each row's states: 04's `extract_hidden_states` command (`hidden.vllm`'s
    settings, connector and shared path `hidden.vllm.files_dir`), served under the name the trainer is given as
    `--verifier-name-or-path` (its loader refuses a server whose /v1/models names another model)."""

    v = params.hidden.vllm or HiddenVLLMParams(launch=True)
    v = v.model_copy(update={"server": v.server.model_copy(update={"port": v.server.port or 8000})})
    p = params.model_copy(update={"hidden": params.hidden.model_copy(update={"vllm": v})})
    cmd = hidden_command(p, layers)
    name = model_dir(p)
    argv = list(cmd.argv)
    argv[argv.index("--served-model-name") + 1] = name
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    env = dict(cmd.env) | ({"PYTHONPATH": ":".join(cmd.extra_env_path)} if cmd.extra_env_path else {})
    return {"argv": argv, "env": env, "shell": " ".join([*(f"{k}={shlex.quote(x)}" for k, x in env.items()),
                                                          shlex.join(argv)]),
            "base_url": cmd.base_url, "served_model_name": name,
            "connector": "cpu" if kv.get("kv_connector_module_path") else "stock", "kv_connector": kv["kv_connector"],
            "shared_storage_path": str(files_dir(p)), "layer_ids": engine_layer_ids(layers),
            "speculative_config": spec, "kv_transfer_config": kv}


def capture_server(params: Any, layers: AuxLayers, max_length: int) -> dict[str, Any]:
    """The flags of SpecForge 0.2.0's patched SGLang capture server (`launch_plan._managed_local_services`); with the
    managed stack in `specforge.yaml` SpecForge starts it itself, and `specforge train -c specforge.yaml --plan`
    prints its full command. For servers started by hand (several, at scale) this is the command."""

    tp = params.hidden.sglang.server.tensor_parallel_size if params.hidden.sglang else 1
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model_dir(params), "--dtype", "bfloat16"]
    if params.model.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += ["--skip-tokenizer-init", "--tp-size", str(tp), "--chunked-prefill-size", "-1", "--enable-spec-capture",
             "--spec-capture-method", "eagle3", "--spec-capture-aux-layer-ids", *map(str, layers.layer_outputs),
             "--host", "0.0.0.0", "--port", str(CAPTURE_PORT), "--disable-radix-cache",
             "--context-length", str(max_length + CAPTURE_HEADROOM)]
    return {"argv": argv, "shell": shlex.join(argv), "tp_size": tp, "aux_layer_ids": list(layers.layer_outputs),
            "context_length": max_length + CAPTURE_HEADROOM}


# ---------------------------------------------------------------- speculators


class _Speculators:
    """speculators' `datasets` folder of the rows, a chunk at a time (`add`), through its own prepare-data function (its
    own library), each chunk checked row by row against the window rule; without speculators installed, the same rows
    written by us. `finish` says which."""

    def __init__(self, out: Path, max_length: int, procs: int | None) -> None:
        try:
            from speculators.data_generation.preprocessing import build_speculator_training_dataset as build
        except ImportError:
            build = None
        self.build, self.made_by = build, FALLBACK_MADE_BY if build is None else SPECULATORS_MADE_BY
        self.L, self.procs, self.shards, self.done = max_length, procs, DatasetShards(out), 0
        self.digest = hashlib.blake2b(digest_size=8)

    def add(self, chunk: Sequence[Any]) -> None:
        from datasets import Dataset

        L = self.L
        kept = [s for s in chunk if sum(s.loss_mask[:L])]
        self.digest.update("".join(f"{s.key}\n" for s in kept).encode())
        if self.build is None:
            self.shards.add(rows_dataset(kept, L))
            self.done += len(kept)
            return
        raw = Dataset.from_dict({"input_ids": [list(map(int, s.input_ids)) for s in chunk],
                                 "loss_mask": [list(map(int, s.loss_mask)) for s in chunk]})
        # processor: only asked whether it is multimodal, and pre-tokenized rows never reach that branch
        ds = self.build(raw, None, max_length=L, num_proc=self.procs)
        if len(ds) != len(kept):
            raise OnlineExportError(f"speculators kept {len(ds)} of {len(chunk)} rows where the window rule keeps "
                                    f"{len(kept)}: its prepare-data rule changed (speculators version?)")
        for i, (row, s) in enumerate(zip(ds.with_format(None), kept), start=self.done):
            if row["input_ids"] != list(s.input_ids[:L]) or row["loss_mask"] != list(s.loss_mask[:L]):
                raise OnlineExportError(f"speculators' prepare-data changed row {i} ({s.key}): its ids or mask differ")
        self.shards.add(ds)
        self.done += len(kept)

    def finish(self) -> str:
        self.shards.finish(self.digest.hexdigest())
        return self.made_by

    def abort(self) -> None:
        self.shards.abort()


class _Lines:
    """A JSONL file written a chunk of lines at a time through a temp file, renamed over the file by `finish`."""

    def __init__(self, path: Path, line: Callable[[Any], Any]) -> None:
        self.path, self.line, self.tmp = path, line, path.with_name(path.name + ".tmp")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed by finish or abort

    def add(self, chunk: Sequence[Any]) -> None:
        self.f.write(b"".join(orjson.dumps(self.line(s)) + b"\n" for s in chunk))

    def finish(self) -> None:
        self.f.close()
        os.chmod(self.tmp, umask_mode())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def prompt_line(s: Any) -> dict[str, Any]:
    """SpecForge's pre-tokenized prompt record of a row (`data/prompt_builder.py` reads both keys as ids and mask)."""
    return {"id": str(s.key), "input_ids": list(s.input_ids), "loss_mask": list(s.loss_mask)}


class Rows:
    """An online format's files that hold the rows, written as the rows go by (`add`, a chunk at a time, in mix order),
    each through a temp name until `finish`: speculators' dataset or SpecForge's `prompts.jsonl`, and
    `conversations.jsonl` (`conversation`: a row's record as a conversation). `run_export` feeds every format's in
    its one pass over the rows."""

    def __init__(self, fmt: str, out: Path, max_length: int, conversation: Callable[[Any], Any],
                 procs: int | None = 1) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.conversations = _Lines(out / "conversations.jsonl", lambda s: conversation(s.record))
        self.data: Any = (_Speculators(out, max_length, procs) if fmt == "speculators_online"
                          else _Lines(out / PROMPTS_FILE, prompt_line))

    def add(self, chunk: Sequence[Any]) -> None:
        self.data.add(chunk)
        self.conversations.add(chunk)

    def finish(self) -> str | None:
        """Rename every file into place; speculators: who made its dataset (`made_by`)."""
        self.conversations.finish()
        return self.data.finish()

    def abort(self) -> None:
        self.conversations.abort()
        self.data.abort()


def rows_for(fmt: str, out: Path, samples: Any, conversation: Callable[[Any], Any], w: dict[str, Any]) -> Rows:
    """`Rows` of `fmt` for these samples: speculators' function in a worker process when the rows are one call (as
    prepare-data maps), in this process when it is called per chunk (datasets starts a process pool per call)."""
    one = len(samples) <= getattr(samples, "chunk_rows", len(samples))
    return Rows(fmt, out, w["max_length"], conversation, 1 if one else None)


def write_speculators_online(params: Any, out: Path, vocab: Any, counts: np.ndarray, w: dict[str, Any],
                             made_by: str) -> tuple[dict[str, str], dict[str, Any]]:
    """`speculators_online/` beside its dataset (`Rows`): the draft vocabulary, no hidden_states/, the states server's
    command."""

    n = len(vocab.d2t)
    files = Speculators().write_export_vocab(out, vocab.d2t, vocab.t2d, counts)
    np.save(out / f"d2t-{n}.npy", np.ascontiguousarray(vocab.d2t, dtype=np.int64))
    np.save(out / f"t2d-{n}.npy", np.ascontiguousarray(vocab.t2d, dtype=bool))
    files |= {"data-*.arrow, dataset_info.json, state.json": f"datasets save_to_disk: input_ids, loss_mask, seq_len "
                                                             f"(torch), made by {made_by.split(' ')[0]}",
              f"d2t-{n}.npy, t2d-{n}.npy": f"draft vocabulary, found by --draft-vocab-size {n}"}
    layers, source = layer_plan(params)
    server = states_server(params, layers)
    folder = str(out.resolve())
    train = ["speculators", "train", "--speculator-type", "eagle3", "--verifier-name-or-path", model_dir(params),
             "--data-path", folder, "--draft-vocab-size", str(n), "--target-layer-ids", *map(str, layers.hf_indices),
             "--on-missing", "generate", "--vllm-endpoint", server["base_url"], "--hidden-states-backend", "file",
             "--total-seq-len", str(max(SPECULATORS_SEQ, w["max_length"])), "--save-path", "speculators_out"]
    extra = {"made_by": made_by, "hidden_states": "none stored: generated per row by the states server while training",
             "layers": {"source": source, "num_layers": layers.num_layers, "hf_indices": list(layers.hf_indices),
                        "layer_outputs": list(layers.layer_outputs), "vllm_layer_ids": server["layer_ids"]},
             "states_server": server, "train_argv": train, "train_command": shlex.join(train)}
    return files, extra


# ---------------------------------------------------------------- SpecForge


def write_specforge_online(params: Any, out: Path, vocab: Any, counts: np.ndarray, w: dict[str, Any],
                           made_by: str | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """`specforge_online/` beside its `prompts.jsonl` (`Rows`): `vocab_mapping.pt`, `specforge.yaml` (online: managed
    capture stack)."""

    L = w["max_length"]
    save_vocab_mapping(out / VOCAB_FILE, vocab.d2t, vocab.t2d)
    layers, source = layer_plan(params)
    cap = capture_server(params, layers, L)
    tp = cap["tp_size"]
    deployment = {"mode": "disaggregated", "disaggregated": {
        "control_dir": "specforge_control", "backend": "mooncake",
        "managed_local": {"trainer_cuda_visible_devices": [str(tp)],
                          "capture_servers": [{"port": CAPTURE_PORT, "tp_size": tp,
                                               "cuda_visible_devices": [str(i) for i in range(tp)]}]}}}
    target = write_config(params, _model_dir(params), out, L, int(len(vocab.d2t)),
                          data={"prompts_path": PROMPTS_FILE, "max_length": L},
                          model_extra={"aux_hidden_state_layer_ids": list(layers.layer_outputs)},
                          extra={"deployment": deployment})
    files = {PROMPTS_FILE: "one JSON line per row, mix order: id, input_ids, loss_mask (0/1): data.prompts_path",
             VOCAB_FILE: "{d2t int64 (target = draft + d2t), t2d bool}: model.vocab_mapping_path",
             "specforge.yaml": "SpecForge's online config, run from this folder: prompts_path, max_length, aux layer "
                               "ids, a managed capture server + Mooncake on this node (edit deployment for more)"}
    extra = {"specforge_target": target, "capture_server": cap,
             "layers": {"source": source, "layer_outputs": list(layers.layer_outputs),
                        "hf_indices": list(layers.hf_indices)},
             "train_command": "cd <this folder> && specforge train -c specforge.yaml",
             "plan_command": "specforge train -c specforge.yaml --plan"}
    return files, extra


# ---------------------------------------------------------------- one online format


def write_online(params: Any, samples: Any, out: Path, fmt: str, vocab: Any, counts: np.ndarray,
                 drift: dict[str, Any], conversation: Callable[[Any], Any], w: dict[str, Any] | None = None,
                 rows: Rows | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """Write `fmt` (an ONLINE_FORMATS name) of the mix into `out`; return its files and its `handoff.json`.

    `samples`: the export's rows (`run.Selection`, read a chunk at a time, or a list); `conversation`: a record as
    a conversation. `w`: their `window` at `export.online_max_length`, and `rows`: their files already fed every row
    (`run_export` makes both in its one pass over the rows); made here when None."""
    if fmt not in ONLINE_FORMATS:
        raise OnlineExportError(f"unknown online format {fmt!r}; online formats: {', '.join(ONLINE_FORMATS)}")
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    w = w if w is not None else window(samples, params.export.online_max_length)
    if rows is None:
        rows = rows_for(fmt, out, samples, conversation, w)
        try:
            for chunk in chunks_of(samples):
                rows.add(chunk)
        except BaseException:
            rows.abort()
            raise
    made_by = rows.finish()
    writer = write_speculators_online if fmt == "speculators_online" else write_specforge_online
    files, extra = writer(params, out, vocab, counts, w, made_by)
    files["conversations.jsonl"] = ("the rows as text (id, conversations): for trainers that take only text "
                                    "(TorchSpec, Model-Optimizer), which re-tokenize it (manifest text_trainers)")
    keys, lengths = keys_of(samples), lengths_of(samples)
    handoff = {"format": fmt, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "rows": len(w["kept"]), "tokens": sum(min(lengths[i], w["max_length"]) for i in w["kept"]),
               "keys": [str(keys[i]) for i in w["kept"]], "max_length": w["max_length"],
               "window": {k: v for k, v in w.items() if k != "kept"}, "draft_vocab_size": int(len(vocab.d2t)),
               "text_trainers": {k: drift.get(k) for k in ("rows", "reproduced", "differ", "differing_keys")},
               **extra, "files": files, "seconds": round(time.perf_counter() - t0, 3)}
    write_atomic(out / HANDOFF, orjson.dumps(handoff, option=orjson.OPT_INDENT_2))
    return files, handoff
