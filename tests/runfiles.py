"""Run files for tests: a hand-made record, a JSONL writer, and the ledger invariant (shared by several test files)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import orjson

from eagle3data.core.profiles import SMOLLM2, Token, ToolCallTokens
from eagle3data.rebuild.provider_tokens import fast_backend, mapper_for
from eagle3data.core.reader import SampleKey
from eagle3data.core.records import read_records

# A reasoning stand-in on the SmolLM2 vocabulary (ids of its unused added tokens), so the
# reasoning, guard and Kimi-style tool-call paths run on a second real vocabulary.
SMOL_REASONING = replace(
    SMOLLM2, name="smollm2-reasoning-standin", guard=Token("<|endoftext|>", 0),
    reasoning_open=Token("<issue_start>", 8), reasoning_close=Token("<issue_closed>", 10),
    tool_calls=ToolCallTokens(style="kimi", section_begin=Token("<jupyter_start>", 11),
                              section_end=Token("<jupyter_output>", 14), call_begin=Token("<jupyter_text>", 12),
                              argument_begin=Token("<jupyter_code>", 13), call_end=Token("<jupyter_script>", 15)),
)


def make_record(ds: str, sid, prompt=(1, 2, 3), output=(4, 5, 2), **kw) -> dict:
    """A journal record; `output=None` makes an API-style record without output ids."""
    r = {"dataset": ds, "sample_id": sid, "source": "local", "model": "m", "profile": "smollm2",
         "prompt_ids": list(prompt), "output_ids": None if output is None else list(output),
         "ids_exact": output is not None, "finish_reason": "stop"}
    r.update(kw)
    return r


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write rows as a JSONL file, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def assert_ledger_adds_up(run_dir: Path) -> dict:
    """The run's ledger.json, after checking every planned sample is done, failed, skipped or cancelled once."""
    from eagle3data.generate.ledger import read_ledger

    led = read_ledger(run_dir)
    for name, d in led["datasets"].items():
        assert d["in_flight"] == 0, name
        assert d["done"] + d["errors"] + d["skipped"] + d["cancelled"] == d["planned"], (name, d)
        assert len(d["skipped_ids"]) == d["skipped"] and len(d["cancelled_ids"]) == d["cancelled"]
    return led


def key(dataset: str, sample_id: object, turn: int | None = None) -> SampleKey:
    """The key of the row (dataset, sample_id, turn): what `SampleKey.of` makes of a record with those fields."""
    return SampleKey.of({"dataset": dataset, "sample_id": sample_id, "turn": turn})


def synthetic_api_record(dataset: str, sample_id: int | str, *, reasoning: str | None, content: str | None,
                         tool_calls: list[dict[str, Any]] | None = None, finish_reason: str = "stop",
                         completion_tokens: int | None = None, provider: str | None = "synthetic",
                         profile: str = "qwen3", prompt_ids: list[int] | None = None,
                         messages: list[dict[str, Any]] | None = None, reasoning_tokens: int | None = None,
                         logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A journal record as the `openai` backend writes it: text fields and usage, no output ids."""
    extra = {"logprobs": logprobs} if logprobs is not None else {}
    return extra | {
        "dataset": dataset, "sample_id": sample_id, "source": "api", "model": "synthetic", "profile": profile,
        "messages": messages or [{"role": "user", "content": f"question {sample_id}"}], "prompt_ids": prompt_ids,
        "output_ids": None, "ids_exact": False, "reasoning": reasoning, "content": content,
        "tool_calls": tool_calls, "finish_reason": finish_reason,
        "usage": {"completion_tokens": completion_tokens, "reasoning_tokens": reasoning_tokens}, "provider": provider,
    }


def logprob_entries(ids: Sequence[int], tokenizer: Any, *, with_bytes: bool = True) -> list[dict[str, Any]]:
    """OpenAI-style `logprobs.content` entries for ids: what a provider returns with `logprobs: true`."""
    bt = fast_backend(tokenizer)
    m = mapper_for(bt)
    byte_of = {c: b for b, c in m.char_of.items()}
    out = []
    for i in ids:
        piece = bt.id_to_token(int(i))
        if piece in m.added:
            raw = piece.encode()
        else:
            raw = bytes(byte_of[c] for c in piece)
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": -0.1,
                    "bytes": list(raw) if with_bytes else None, "top_logprobs": []})
    return out


def iter_run_records(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Records of every dataset journal of a run, in file order."""
    for p in sorted((Path(run_dir) / "records").glob("*.jsonl")):
        yield from read_records(p)


def wait_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    """Wait until `path` holds `n` lines, while the process writing it still runs (a test of a live run)."""
    while not path.exists() or path.read_bytes().count(b"\n") < n:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


def wait_figure(run_dir: Path, key: str, n: int, proc: subprocess.Popen, since: float) -> None:
    """Wait until 04's live progress (progress.json, written after `since`) shows figure `key` >= n for this run."""
    while True:
        try:
            prog = orjson.loads((run_dir / "progress.json").read_bytes())
        except (OSError, ValueError):
            prog = {}
        if (prog.get("stage") == "04_extract_hidden" and prog.get("updated_at", 0) > since and not prog.get("final")
                and ((prog.get("figures") or {}).get(key) or 0) >= n):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


def as_written(hdir: Path, *files: str | Path) -> None:
    """Record store files a test rewrote (a planted engine fault) as 04 would have had it written those bytes: each
    file's content checksum journaled and put in the index, so only the checks under test see the change (a file
    changed after 04 wrote it fails its `checksum` instead: tests/test_verify_hidden.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3data.hidden.store.checksum import file_checksum, record

    hdir = Path(hdir)
    sums = {}
    for f in files:
        rel = Path(f).relative_to(hdir).as_posix() if Path(f).is_absolute() else Path(f).as_posix()
        sums[rel] = file_checksum(hdir / rel)
        record(hdir, 0, rel, sums[rel])
    t = pq.read_table(hdir / "index.parquet")
    if "checksum" in t.column_names:
        col = [sums.get(s, c) for s, c in zip(t["shard"].to_pylist(), t["checksum"].to_pylist())]
        t = t.set_column(t.column_names.index("checksum"), "checksum", pa.array(col, pa.string()))
        pq.write_table(t, hdir / "index.parquet")


def ci_records_through_04(ci_run: Any, root: Path, storage: str | None = "bf16") -> Any:
    """The ci run's records copied into `root`, stored by 04 in speculators' layout (`storage`, bf16 unless given;
    None: the layout's default; HF forward, no probe) with a 64-token draft vocabulary for 05: the params of that run
    (05 left to the caller)."""
    import shutil

    import pytest

    from eagle3data.core.params import load_params
    from eagle3data.hidden.extract import run_extract

    shutil.copytree(ci_run.run_dir / "records", root / "ci" / "records")
    p = load_params(Path(__file__).resolve().parents[1] / "params" / "ci.yaml",
                    {"output_root": str(root), "hidden.probe_batches": 0, "hidden.layout": "speculators",
                     "export.draft_vocab_size": 64} | ({"hidden.storage": storage} if storage else {}))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RANK", raising=False)
        mp.delenv("WORLD_SIZE", raising=False)
        res = run_extract(p, progress=False)
    assert res.merged and res.verification.ok
    return p
