"""What 04's content checksum costs against writing the shard it guards; writes outputs/bench/checksum.json.

A shard of `--mb` MiB of bf16 states (plus ids and mask, as `ShardWriter` lays them out) is written as 04 writes it
(`save_file` into `atomic_path` with fsync), then hashed by `store.checksum.file_checksum` (XXH3-128, reading the
file just written, as the writers do while its bytes are in the page cache). The ratio is the checksum's time over
the write's (lower is better; goal <= 0.2 in bench/summary.py). For the choice, the same bytes through hashlib's
blake2b and sha256 and zlib's crc32 (GB/s, in memory). Rounds: `--rounds`, each on a new file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="shard size in MiB (04's default cap is 512)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import hashlib
    import zlib

    import torch
    from safetensors.torch import save_file

    from eagle3data.core.atomic import atomic_path
    from eagle3data.hidden.store.checksum import ALGORITHM, file_checksum

    load = os.getloadavg()
    hidden, states = 576, 5
    tokens = args.mb * 2**20 // (hidden * states * 2)
    g = torch.Generator().manual_seed(0)
    tensors = {"hidden_states": torch.randn(tokens, states, hidden, generator=g).to(torch.bfloat16),
               "input_ids": torch.randint(0, 49152, (tokens,), generator=g, dtype=torch.int32),
               "loss_mask": torch.ones(tokens, dtype=torch.uint8)}
    write_s, sum_s = [], []
    with tempfile.TemporaryDirectory(dir=OUT.parent if OUT.parent.exists() else None) as d:
        for r in range(args.rounds):
            path = Path(d) / f"r000-{r:05d}.safetensors"
            t0 = time.perf_counter()
            with atomic_path(path, fsync=True) as tmp:
                save_file(tensors, str(tmp), metadata={"eagle3data": "{}"})
            t1 = time.perf_counter()
            file_checksum(path)
            t2 = time.perf_counter()
            write_s.append(t1 - t0)
            sum_s.append(t2 - t1)
            size = path.stat().st_size
            path.unlink()
    blob = memoryview(tensors["hidden_states"].view(torch.uint8).numpy().tobytes())
    speeds = {}
    for name, f in (("blake2b", lambda: hashlib.blake2b(blob).digest()), ("sha256", lambda: hashlib.sha256(blob).digest()),
                    ("crc32", lambda: zlib.crc32(blob))):
        t = time.perf_counter()
        f()
        speeds[name] = round(len(blob) / (time.perf_counter() - t) / 1e9, 2)
    per_round = [round(s / w, 4) for s, w in zip(sum_s, write_s)]
    out = {"algorithm": ALGORITHM, "shard_bytes": size, "rounds": args.rounds,
           "write_seconds": [round(x, 4) for x in write_s], "checksum_seconds": [round(x, 4) for x in sum_s],
           "checksum_over_write": round(sorted(per_round)[len(per_round) // 2], 4),
           "checksum_over_write_per_round": per_round,
           "gb_per_s": {"write_fsync": round(size / min(write_s) / 1e9, 2), ALGORITHM: round(size / min(sum_s) / 1e9, 2),
                        **speeds},
           "load_average_at_start": list(load)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "checksum.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
