"""speculators (0.9.0): pre-norm final state, `hidden_states/hs_<i>.safetensors`, a `datasets` folder, `d2t-<N>.npy`.

Checked against the released code: `speculators train --data-path DIR` reads
`speculators.train.data.ArrowDataset(datapath=DIR)`: a `datasets` `save_to_disk` folder with
`input_ids`, `loss_mask`, `seq_len` in torch format, and `hidden_states/hs_<row>.safetensors`
holding `hidden_states` [n, 4, H] (3 aux + the **pre-norm** last-layer output: speculators
applies the verifier's norm itself) and `token_ids` int64 [n] (row i <-> file i); 04's
per-sample file (layout `speculators`) is that file, plus `loss_mask` uint8 [n], `post_norm`
[n, H] when stored and its `eagle3data` description. Its training CLI discovers
`d2t-<N>.npy` / `t2d-<N>.npy` in the data folder for `--draft-vocab-size N`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3data.core.atomic import atomic_path
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
        import numpy as np
        import torch

        nz = np.flatnonzero(counts)
        torch.save({int(i): int(counts[i]) for i in nz}, out / "token_freq.pt")
        np.save(out / "d2t.npy", d2t)
        np.save(out / "t2d.npy", t2d)
        return {"token_freq.pt": "torch dict {token_id: count} of output tokens (loss_mask 1)",
                "d2t.npy": "draft-to-target offsets, int64", "t2d.npy": "target-in-draft membership, bool"}

    def write_handoff_files(self, out: Path, samples: Sequence[Any], d2t: Any, t2d: Any, params: Any,
                            model_dir: Callable[[], Path | None]) -> tuple[dict[str, str], dict[str, Any]]:
        import numpy as np

        write_dataset(samples, out)
        n = len(d2t)
        np.save(out / f"d2t-{n}.npy", np.ascontiguousarray(d2t, dtype=np.int64))
        np.save(out / f"t2d-{n}.npy", np.ascontiguousarray(t2d, dtype=bool))
        files = {"data-*.arrow, dataset_info.json, state.json":
                 "datasets save_to_disk: input_ids, loss_mask, seq_len (torch)",
                 HS_DIR + "/": "hs_<row>.safetensors: hidden_states [n,4,H] (3 aux + pre-norm), token_ids int64 [n]",
                 f"d2t-{n}.npy, t2d-{n}.npy": "draft vocabulary, found by --draft-vocab-size " + str(n)}
        return files, {}


def write_dataset(samples: Sequence[Any], out: Path) -> None:
    """The `datasets` folder speculators' ArrowDataset loads: input_ids, loss_mask, seq_len in torch format."""
    from datasets import Dataset, Features, Sequence as Seq, Value

    feats = Features({"input_ids": Seq(Value("int64")), "loss_mask": Seq(Value("int64")), "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [list(map(int, s.input_ids)) for s in samples],
                            "loss_mask": [list(map(int, s.loss_mask)) for s in samples],
                            "seq_len": [len(s.input_ids) for s in samples]}, features=feats)
    for old in out.glob("data-*.arrow"):
        old.unlink()
    ds.with_format("torch").save_to_disk(str(out))
