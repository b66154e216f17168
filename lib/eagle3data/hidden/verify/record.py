"""04's manifest records a store's verification, with a fingerprint of what was verified: 05 reads the record, and a
later merge of the same store keeps it (`keep_verification`)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import orjson

from eagle3data.core.atomic import tmp_tag
from eagle3data.hidden.store.format import INDEX_FILE, INFO_FILE


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path) + tmp_tag()
    Path(tmp).write_bytes(data)
    os.replace(tmp, path)


def _record_in_index(hdir: Path, summary: dict[str, Any]) -> None:
    """04's manifest (`index.json`) records the verification: ok, counts, when, and the store's fingerprint; 05
    reads it, and a later merge of the same store keeps it (`keep_verification`)."""
    info = orjson.loads((hdir / INFO_FILE).read_bytes())
    info["verification"] = {k: summary[k] for k in ("ok", "samples", "failed_samples", "recomputed", "positions",
                                                     "verified_at")}
    info["verification"]["failed_checks"] = {k: v["failed"] for k, v in summary["checks"].items() if v["failed"]}
    info["verification"]["fingerprint"] = store_fingerprint(hdir, info)
    _write(hdir / INFO_FILE, orjson.dumps(info, option=orjson.OPT_INDENT_2))


FINGERPRINT_INFO = ("model", "states", "final_state", "layout", "hidden_size", "dtype", "storage", "hf_indices",
                    "samples", "tokens", "shards")
FINGERPRINT_INDEX = ("key", "position", "shard", "offset", "length", "loss_tokens")


def store_fingerprint(hdir: Path, info: dict[str, Any]) -> str:
    """What the verification saw: the index rows (key, position, file, offset, length), each file's size and
    modification time, and the store's kind (states, dtype, layout, ...), as one digest. A rewritten or touched
    file, another row, or another kind of store gives another digest."""
    import pyarrow.parquet as pq

    idx = pq.read_table(hdir / INDEX_FILE, columns=list(FINGERPRINT_INDEX)).to_pydict()
    files = {}
    for name in sorted(set(idx["shard"])):
        st = (hdir / name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    blob = orjson.dumps({"info": {k: info.get(k) for k in FINGERPRINT_INFO}, "index": idx, "files": files},
                        option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def keep_verification(hdir: Path, before: dict[str, Any]) -> bool:
    """After the index was rewritten (`merge.merge_index`): carry `before`'s verification over when the store is
    provably the one verified (same fingerprint); True when kept. Otherwise the new index has none."""
    ver = before.get("verification")
    if not ver or not ver.get("fingerprint"):
        return False
    info = orjson.loads((hdir / INFO_FILE).read_bytes())
    if store_fingerprint(hdir, info) != ver["fingerprint"]:
        return False
    info["verification"] = ver
    _write(hdir / INFO_FILE, orjson.dumps(info, option=orjson.OPT_INDENT_2))
    return True
