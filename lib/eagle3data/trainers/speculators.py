"""speculators (0.9.0): pre-norm final state, `hidden_states/hs_<i>.safetensors`, a `datasets` folder, `d2t-<N>.npy`.

Checked against the released code: `speculators train --data-path DIR` reads
`speculators.train.data.ArrowDataset(datapath=DIR)`: a `datasets` `save_to_disk` folder with
`input_ids`, `loss_mask`, `seq_len` in torch format, and `hidden_states/hs_<row>.safetensors`
holding `hidden_states` [n, 4, H] (3 aux + the **pre-norm** last-layer output: speculators
applies the verifier's norm itself) and `token_ids` int64 [n] (row i <-> file i); 04's
per-sample file (layout `speculators`) is that file, plus `loss_mask` uint8 [n], `post_norm`
[n, H] when stored and its `eagle3data` description. Its training CLI discovers
`d2t-<N>.npy` / `t2d-<N>.npy` in the data folder for `--draft-vocab-size N`.

The `datasets` folder is written a chunk of rows at a time (`write_dataset`, `DatasetShards`: datasets' own
ArrowWriter in `save_to_disk`'s layout), so neither 05's offline hand-off nor its online one
(`export/online.py`, through the same writer) holds the run's ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from eagle3data.core.atomic import atomic_path, tmp_tag, umask_mode, write_atomic
from eagle3data.core.quant import quantize
from eagle3data.trainers.base import AUX_STATES, HandoffError, Trainer

FP8_SCALES = "hidden_states_scales"  # hs-connectors' name of the per-token scales beside FP8 `hidden_states`


def _fp8_states(values: Any, scales: Any) -> Any:
    """FP8 values with their per-token (or per token and state) scales, as bf16: FP8Transfer's own arithmetic
    (`values.to(bf16) * scales.to(bf16)`), so what 04 validates is exactly what speculators trains on."""
    import torch

    return values.to(torch.bfloat16) * scales.to(torch.bfloat16)

HS_DIR = "hidden_states"  # the per-sample files, under the dataset folder


class Speculators(Trainer):
    """vllm speculators' EAGLE-3: 3 aux + pre-norm states in one tensor, token ids int64."""

    name = "speculators"
    final_state = "pre_norm"
    sample_suffix = ".safetensors"
    id_mask_bytes = 8 + 1  # token_ids int64, loss_mask uint8
    handoff_dir = HS_DIR
    export_files = ("data.parquet",)

    def handoff_name(self, row: int) -> str:
        return f"hs_{row}.safetensors"

    def state_bytes_per_token(self, codec: Any, hidden_size: int) -> int:
        """Its file holds `hidden_states` (3 aux + pre-norm) and, when stored, `post_norm`: an FP8 file scales
        each tensor on its own (`hidden_states_scales`, `post_norm_scales`), as `write_sample` does."""
        if not codec.quantized:
            return codec.bytes_per_token(hidden_size)
        st = codec.aux
        return sum(st.bytes_per_token(n, hidden_size) for n in (AUX_STATES + 1, codec.states - AUX_STATES - 1) if n)

    def write_sample(self, path: Path, input_ids: Any, loss_mask: Any, aux: Any, finals: dict[str, Any],
                     meta: str | None = None, *, tmp_suffix: str = ".tmp", storage: Any = None) -> int:
        import torch
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        hs = torch.cat([aux, finals["pre_norm"][:, None]], 1)
        tensors = {"token_ids": torch.as_tensor(input_ids, dtype=torch.long).clone(),
                   "loss_mask": torch.as_tensor(loss_mask, dtype=torch.uint8).clone()}
        if storage is None:
            tensors["hidden_states"] = hs.contiguous()
            if "post_norm" in finals:
                tensors["post_norm"] = finals["post_norm"].contiguous().clone()
        else:  # hs-connectors' FP8 file: float8_e4m3fn values, fp32 scales [n, 1 | 4, 1] (FP8Transfer reads it)
            if storage.format != "fp8_e4m3" or storage.scale not in ("token", "token_state"):
                raise HandoffError(f"{path}: speculators reads fp8_e4m3 with per-token scales natively, not "
                                   f"{storage.name}: store shards and let 05 convert")
            tensors["hidden_states"], tensors[FP8_SCALES] = quantize(hs, storage)
            if "post_norm" in finals:
                tensors["post_norm"], tensors["post_norm_scales"] = quantize(finals["post_norm"][:, None], storage)
        with atomic_path(path, tmp_suffix=tmp_suffix, fsync=True) as tmp:  # the umask's mode: save_file makes 0600
            save_file(tensors, str(tmp), metadata=None if meta is None else {"eagle3data": meta})
        return path.stat().st_size

    def read_sample(self, path: Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        raw = load_file(str(path))
        hs = raw["hidden_states"]
        if FP8_SCALES in raw:  # an FP8 file: dequantized as FP8Transfer does, in fp32 first
            hs = _fp8_states(hs, raw[FP8_SCALES])
        finals = {"pre_norm": hs[:, AUX_STATES]}
        if "post_norm" in raw:
            post = raw["post_norm"]
            finals["post_norm"] = _fp8_states(post, raw["post_norm_scales"])[:, 0] if "post_norm_scales" in raw else post
        return {"input_ids": raw["token_ids"], "loss_mask": raw["loss_mask"], "aux": hs[:, :AUX_STATES],
                "finals": finals}

    def read_ids(self, path: Path) -> tuple[list[int], list[int]]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor("token_ids").tolist(), f.get_tensor("loss_mask").tolist()

    def read_meta(self, path: Path) -> str | None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("eagle3data")

    def write_export_vocab(self, out: Path, d2t: Any, t2d: Any, counts: Any) -> dict[str, str]:
        import torch

        nz = np.flatnonzero(counts)
        torch.save({int(i): int(counts[i]) for i in nz}, out / "token_freq.pt")
        np.save(out / "d2t.npy", d2t)
        np.save(out / "t2d.npy", t2d)
        return {"token_freq.pt": "torch dict {token_id: count} of output tokens (loss_mask 1)",
                "d2t.npy": "draft-to-target offsets, int64", "t2d.npy": "target-in-draft membership, bool"}

    def write_handoff_files(self, out: Path, samples: Sequence[Any], d2t: Any, t2d: Any, params: Any,
                            model_dir: Callable[[], Path | None]) -> tuple[dict[str, str], dict[str, Any]]:
        write_dataset(samples, out)  # a chunk of rows at a time: `samples` is 05's Selection or a list
        n = len(d2t)
        np.save(out / f"d2t-{n}.npy", np.ascontiguousarray(d2t, dtype=np.int64))
        np.save(out / f"t2d-{n}.npy", np.ascontiguousarray(t2d, dtype=bool))
        files = {"data-*.arrow, dataset_info.json, state.json":
                 "datasets save_to_disk: input_ids, loss_mask, seq_len (torch)",
                 HS_DIR + "/": "hs_<row>.safetensors: hidden_states [n,4,H] (3 aux + pre-norm), token_ids int64 [n]",
                 f"d2t-{n}.npy, t2d-{n}.npy": "draft vocabulary, found by --draft-vocab-size " + str(n)}
        return files, {}


def rows_dataset(samples: Sequence[Any], max_length: int | None = None) -> Any:
    """Rows as the `datasets` Dataset speculators' ArrowDataset reads, torch format: `input_ids`, `loss_mask` (int64
    lists) and `seq_len`, each row cut to `max_length` (None: whole)."""
    from datasets import Dataset, Features, Sequence as Seq, Value

    feats = Features({"input_ids": Seq(Value("int64")), "loss_mask": Seq(Value("int64")), "seq_len": Value("int64")})
    ids = [list(map(int, s.input_ids[:max_length])) for s in samples]
    return Dataset.from_dict({"input_ids": ids, "loss_mask": [list(map(int, s.loss_mask[:max_length])) for s in samples],
                              "seq_len": [len(x) for x in ids]}, features=feats).with_format("torch")


def write_dataset(rows: Any, out: Path, chunk_rows: int = 256) -> None:
    """The `datasets` folder speculators' ArrowDataset loads (`rows_dataset`'s columns), written a chunk of rows at a
    time through `DatasetShards`: `rows` is 05's Selection (its `chunks()`, read as they are written) or a sequence of
    samples (`chunk_rows` at a time). Its fingerprint is the rows' keys, ids and masks."""
    chunks = rows.chunks() if hasattr(rows, "chunks") else (rows[i:i + chunk_rows]
                                                            for i in range(0, len(rows), max(1, chunk_rows)))
    shards, digest = DatasetShards(out), hashlib.blake2b(digest_size=8)
    try:
        for chunk in chunks:
            for s in chunk:
                digest.update(f"{s.key}\n".encode())
                digest.update(np.asarray(s.input_ids, dtype=np.int64).tobytes())
                digest.update(np.asarray(s.loss_mask, dtype=np.int64).tobytes())
            shards.add(rows_dataset(chunk))
        if shards.last is None:  # no row at all: an empty dataset of these columns
            shards.add(rows_dataset([]))
        shards.finish(digest.hexdigest())
    except BaseException:
        shards.abort()
        raise


class DatasetShards:
    """The `datasets` folder `Dataset.save_to_disk` writes (`data-XXXXX-of-NNNNN.arrow` by datasets' own ArrowWriter, a
    new file past its MAX_SHARD_SIZE, `state.json`, `dataset_info.json`), filled a chunk's dataset at a time (`add`, in
    order; rows of `input_ids`, `loss_mask` and `seq_len`): each file under a temp name until all are written
    (`finish`), then renamed over the old ones; `abort` removes them. What 05's offline and online speculators
    hand-offs write their rows through."""

    def __init__(self, out: Path) -> None:
        from datasets import config
        from datasets.utils.py_utils import convert_file_size_to_int

        self.out, self.tag, self.limit = out, tmp_tag(), convert_file_size_to_int(config.MAX_SHARD_SIZE)
        self.files: list[Path] = []
        self.writer, self.size, self.first, self.last = None, 0, None, None
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("data-*.arrow.tmp*"):  # a killed run's
            old.unlink()

    def add(self, ds: Any) -> None:
        self.last = ds
        if not len(ds):
            return
        self.first = self.first or ds
        t = ds.with_format("arrow")[:]
        sizes = 16 * np.asarray(t.column("seq_len").to_numpy(), dtype=np.int64) + 16  # int64 ids and mask per token
        at = 0
        while at < len(t):
            if self.writer is None:
                self._open(ds)
            cum = self.size + np.cumsum(sizes[at:])
            full = np.flatnonzero(cum >= self.limit)
            end = at + (int(full[0]) + 1 if len(full) else len(cum))
            self.writer.write_table(t.slice(at, end - at))
            self.size, at = int(cum[end - at - 1]), end
            if len(full):
                self._close()

    def _open(self, ds: Any) -> None:
        from datasets.arrow_writer import ArrowWriter

        self.files.append(self.out / f"data-{len(self.files):05d}.arrow{self.tag}")
        self.writer, self.size = ArrowWriter(features=ds.features, path=str(self.files[-1]), embed_local_files=True), 0

    def _close(self) -> None:
        self.writer.finalize()
        self.writer.close()
        self.writer = None

    def abort(self) -> None:
        """Stopped before the end: this run's temp files go, the folder's files stay as they were."""
        if self.writer is not None:
            self.writer.close()
        for f in self.files:
            f.unlink(missing_ok=True)

    def finish(self, fingerprint: str) -> None:
        from datasets.utils.py_utils import asdict  # save_to_disk's own (leaves out what is None)

        if self.writer is None and not self.files:
            self._open(self.last)  # no row at all: one empty file (save_to_disk writes none: load_from_disk fails)
        if self.writer is not None:
            self._close()
        ds, n = self.first or self.last, len(self.files)
        for old in self.out.glob("data-*.arrow"):
            old.unlink()
        for i, f in enumerate(self.files):
            os.chmod(f, umask_mode())
            os.replace(f, self.out / f"data-{i:05d}-of-{n:05d}.arrow")
        state = {k: ds.__dict__[k] for k in ("_format_columns", "_format_kwargs", "_format_type", "_output_all_columns")}
        state |= {"_fingerprint": fingerprint, "_split": None if ds.split is None else str(ds.split),
                  "_data_files": [{"filename": f"data-{i:05d}-of-{n:05d}.arrow"} for i in range(n)]}
        info = asdict(ds.info)
        write_atomic(self.out / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
        write_atomic(self.out / "dataset_info.json", json.dumps({k: info[k] for k in sorted(info)}, indent=2).encode())
