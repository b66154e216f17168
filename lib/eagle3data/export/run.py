"""Exports for drafter trainers: SpecForge and vllm speculators, plus the EAGLE-3 draft vocabulary.

A run's samples go out in two forms: text conversations (`id`, `conversations` with `role`,
`content`, `reasoning_content`) for trainers that re-template, and token-level records
(`input_ids`, `loss_mask`, per-sample metadata) that keep this project's exact ids.

What goes out is exactly 04's training mix (`hidden/mix.parquet`: same keys, same order, the
same ids and loss masks), so the one selection rule of `mix.py` decides, and every sample left
out carries its one reason from `mix.DROP_REASONS` into `manifest.json`. When 04 has stored
hidden states, the export checks that the hidden-state index holds exactly the mix's keys in
order. Without a written mix (04 off), the mix is built here with the same rule.

The draft vocabulary (`vocab.py`) is computed once per export, from the exported samples, and
written beside every format.

Nothing holds the run: the selection reads the mix's samples `export.chunk_rows` at a time (`rows.py`),
and `run_export` makes the output-token counts, the text trainers' count, the online window and every
online format's row files in one pass over them; what is kept of every row is small (its key, length).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import orjson

from eagle3data.core.atomic import atomic_path, write_atomic
from eagle3data.core.reader import RunFileError, Sample, SampleKey
from eagle3data.core.stream import index_journal
from eagle3data.export.rows import chunks_of
from eagle3data.export.vocab import DraftVocab, add_output_counts, build_draft_vocab, coverage_curve, save_draft_vocab
from eagle3data.trainers.registry import TRAINERS, get_trainer
from eagle3data.core.models import context_limit
from eagle3data.core.peer_logs import PEER_LOG, peers_to_log
from eagle3data.core.profiles import get_profile
from eagle3data.core.provenance import RunParamsError, params_of_run as read, write_provenance
from eagle3data.export.handoff import write_handoff
from eagle3data.hidden.store.failures import empty_mix_line, require_merged_states
from eagle3data.hidden.mix import CHUNK, MANIFEST_FILE, MIX_FILE, Mix, build_mix, hidden_dir, read_mix
from eagle3data.hidden.mix.rows import Records
from eagle3data.hidden.store.format import INDEX_FILE, INFO_FILE
from eagle3data.core.params.export import ONLINE_FORMATS
from eagle3data.export import online, text_drift

FORMATS: tuple[str, ...] = (*TRAINERS, *ONLINE_FORMATS)  # offline hand-offs (a trainer each), then the online ones
META_FIELDS = ("dataset", "sample_id", "turn", "source", "ids_exact", "finish_reason")


class ExportError(RunFileError):
    """Input to an export is unusable; the message names the file, line and field."""


def token_record(s: Sample) -> dict[str, Any]:
    """The token-level line of a sample: id (its key), the row it is made from, input_ids, loss_mask."""
    meta = {k: getattr(s, k) for k in META_FIELDS}
    return {"id": str(s.key), **meta, "input_ids": s.input_ids, "loss_mask": s.loss_mask}


@dataclass
class Selection:
    """What a run offers for export: 04's mix in mix order, each sample with its record, read `chunk_rows` at a time
    (`chunks`, or `for s in sel`); the mix's drops as skips. `samples` holds them all at once (small runs)."""

    mix: Mix = field(default_factory=Mix)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    verdicts_present: bool = False
    include_failed: bool = False
    mix_source: str = ""  # where the mix came from: hidden/mix.parquet, or built here
    hidden_verification: str = "no hidden states"  # verify-hidden's outcome for the store (`_check_verified`)
    chunk_rows: int = CHUNK
    records: Records | None = None  # a written mix's records, by key (a mix built here reads its own)
    _all: list[Sample] | None = field(default=None, repr=False)

    def chunks(self) -> Iterator[list[Sample]]:
        """The samples in mix order, each with its record and that record's finish reason, `chunk_rows` at a time."""
        for ss in self.mix.iter_samples(self.chunk_rows, keep_record=self.records is None):
            recs = self.records([s.key for s in ss]) if self.records is not None else [s.record for s in ss]
            out = []
            for s, rec in zip(ss, recs):
                if rec is None:
                    raise ExportError(f"sample {s.key} is not among the run's records: the mix is stale, rebuild it "
                                      "(run 04 again)")
                out.append(dataclasses.replace(s, finish_reason=rec.get("finish_reason"), record=rec))
            yield out

    def __iter__(self) -> Iterator[Sample]:
        return (s for ss in self.chunks() for s in ss)

    def __len__(self) -> int:
        return len(self.mix)

    @property
    def keys(self) -> list[SampleKey]:
        return self.mix.keys

    @property
    def entries(self) -> list[Any]:
        """The mix's small facts per sample, in mix order (`mix.Entry`: key, source, ids_exact, tokens, loss tokens)."""
        return self.mix.entries

    @property
    def samples(self) -> list[Sample]:
        """Every sample with its record, held in memory (small runs; the export itself reads `chunks`)."""
        if self._all is None:
            self._all = list(self)
        return self._all

    def skipped_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(s["reason"] for s in self.skipped).items()))

    def table(self):
        """Per dataset: exported samples, exact vs rebuilt ids, output tokens, skipped by reason."""
        import pandas as pd

        rows: dict[str, dict[str, int]] = {}
        for e in self.entries:
            r = rows.setdefault(e.dataset, Counter())
            r["exported"] += 1
            r["ids_exact"] += int(e.ids_exact)
            r["ids_rebuilt"] += int(not e.ids_exact)
            r["output_tokens"] += e.loss_tokens
        for s in self.skipped:
            rows.setdefault(s["dataset"], Counter())[f"skipped_{s['reason']}"] += 1
        df = pd.DataFrame.from_dict(rows, orient="index").fillna(0).astype(int).sort_index()
        df.index.name = "dataset"
        return df


# ---------------------------------------------------------------- reading a run


def select_samples(params: Any) -> Selection:
    """The samples to export: 04's training mix in mix order, each with its record; the mix's drops as skips.

    Reads the written mix (`hidden/mix.parquet`) when there is one and checks it against the
    hidden-state index when 04 stored states, and every key against the run's records; otherwise
    builds the mix with the same rule (without writing it). Nothing of the samples is held: the
    Selection reads them `export.chunk_rows` at a time, each time it is iterated. An empty mix is
    refused (one line: its drop reasons): a hand-off of 0 rows is never written.
    """
    run_dir, chunk = params.run_dir, params.export.chunk_rows
    if not (run_dir / "records").is_dir():
        raise ExportError(f"{run_dir} has no records/ folder: is it a run folder (outputs/<run>)?")
    hdir = hidden_dir(params)
    records = None
    if (hdir / MIX_FILE).exists():
        mix, where = read_mix(hdir, chunk), f"{hdir / MIX_FILE} (04's mix)"
        _refuse_empty(mix, hdir / MANIFEST_FILE)
        _check_index(hdir, mix)
        verified = _check_verified(hdir, run_dir, params.export.allow_unverified)
        records = Records({n: index_journal(run_dir, n, ExportError) for n in sorted({k.dataset for k in mix.keys})})
        stale = next((k for k in mix.keys if k not in records), None)
        if stale is not None:
            raise ExportError(f"{hdir / MIX_FILE}: sample {stale} is not among the run's records: the mix is stale, "
                              "rebuild it (run 04 again)")
    else:
        mix = build_mix(params, write=False, max_context=context_limit(params), error=ExportError)
        where = "built here with the mix rule (no hidden/mix.parquet: 04 has not run)"
        _refuse_empty(mix, "the mix built here with 04's rule (04 has not run)")
        verified = "no hidden states"
    man = mix.manifest
    return Selection(mix, list(mix.dropped), verdicts_present=bool(man.get("audit_found")),
                     include_failed=bool((man.get("settings") or {}).get("include_failed")), mix_source=where,
                     hidden_verification=verified, chunk_rows=chunk, records=records)


def _refuse_empty(mix: Any, where: Path | str) -> None:
    """05 exports no hand-off of 0 rows: an empty mix is an ExportError naming its drop reasons."""
    if not len(mix):
        raise ExportError(f"05: nothing to export: {empty_mix_line(mix, where)}")


def _check_index(hdir: Path, mix: Any) -> None:
    """When 04 stored hidden states, its index must hold exactly the mix's keys, in mix order."""
    import pyarrow.parquet as pq


    path = hdir / INDEX_FILE
    if not path.exists():
        return
    stored = [str(k) for k in SampleKey.of_frame(pq.read_table(path).to_pandas())]
    want = [str(k) for k in mix.keys]
    if stored != want:
        first = next((i for i, (a, b) in enumerate(zip(stored, want)) if a != b), min(len(stored), len(want)))
        raise ExportError(f"{path}: the hidden-state index ({len(stored)} samples) differs from the mix "
                          f"({len(want)}) at position {first}: finish 04 (or run it again) before exporting")


def _check_verified(hdir: Path, run_dir: Path, allow: bool) -> str:
    """Refuse a store that verify-hidden has not passed (its `index.json` entry), unless `export.allow_unverified`."""
    if not (hdir / INFO_FILE).exists():
        return "no hidden states"
    ver = orjson.loads((hdir / INFO_FILE).read_bytes()).get("verification")
    state = ("unverified" if ver is None else "passed" if ver.get("ok")
             else f"FAILED ({ver.get('failed_samples')} of {ver.get('samples')} samples)")
    if state != "passed" and not allow:
        raise ExportError(f"{hdir / INFO_FILE}: the hidden states are {state}: run `python -m eagle3data "
                          f"verify-hidden {run_dir}` and read hidden/verify.jsonl, or set "
                          "export.allow_unverified true to export them anyway")
    return state if state == "passed" else f"{state}, exported anyway (export.allow_unverified)"


# ---------------------------------------------------------------- conversations


def conversation(rec: dict[str, Any]) -> dict[str, Any]:
    """SpecForge-style conversation: the prompt messages, then the response as an assistant turn.

    Every assistant turn carries `reasoning_content` (empty string when there was none); tool
    calls go on the response turn as `tool_calls`, tool definitions as top-level `tools`.
    """
    turns: list[dict[str, Any]] = []
    for m in rec.get("messages") or []:
        t = {"role": m.get("role"), "content": m.get("content") if m.get("content") is not None else ""}
        if t["role"] == "assistant":
            t["reasoning_content"] = m.get("reasoning_content", m.get("reasoning")) or ""
        for k in ("tool_calls", "tool_call_id", "name"):
            if m.get(k) is not None:
                t[k] = m[k]
        turns.append(t)
    reply: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or "",
                             "reasoning_content": rec.get("reasoning") or ""}
    if rec.get("tool_calls"):
        reply["tool_calls"] = rec["tool_calls"]
    turns.append(reply)
    out: dict[str, Any] = {"id": str(SampleKey.of(rec)), "conversations": turns}
    if rec.get("tools"):
        out["tools"] = rec["tools"]
    return out


# ---------------------------------------------------------------- writers


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """One JSON line per row as the rows come, through a temp file renamed at the end."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")
            n += 1
    return n


def _write_parquet(path: Path, samples: Any) -> None:
    """The token-level records as parquet, one row group per chunk of samples, through a temp file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.string()), ("dataset", pa.string()), ("sample_id", pa.string()),
                        ("turn", pa.int32()), ("source", pa.string()), ("ids_exact", pa.bool_()),
                        ("finish_reason", pa.string()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int8()))])
    with atomic_path(path) as tmp, pq.ParquetWriter(str(tmp), schema) as w:
        for ss in chunks_of(samples):
            w.write_table(pa.table([[str(s.key) for s in ss], [s.dataset for s in ss], [str(s.sample_id) for s in ss],
                                    [s.turn for s in ss], [s.source for s in ss], [s.ids_exact for s in ss],
                                    [s.finish_reason for s in ss], [s.input_ids for s in ss],
                                    [s.loss_mask for s in ss]], schema=schema))


# the token files of an export, by name: how each is written and what it holds (a trainer names those it takes)
_TOKEN_FILES = {
    "conversations.jsonl": (
        lambda path, samples: _write_jsonl(path, (conversation(s.record) for s in samples)),
        "SpecForge conversations (id, conversations[role, content, reasoning_content], tools): text, re-templated by "
        "the trainer"),
    "token_ids.jsonl": (
        lambda path, samples: _write_jsonl(path, (token_record(s) for s in samples)),
        "token-level records (id, dataset, sample_id, turn, source, ids_exact, finish_reason, input_ids, loss_mask): "
        "exact ids"),
    "data.parquet": (_write_parquet, "token-level records (input_ids, loss_mask + metadata columns): exact ids"),
}


def export(run_dir: str | Path, out: str | Path, fmt: str, sel: Selection, counts: np.ndarray,
           vocab: DraftVocab, params: Any = None, drift: dict[str, Any] | None = None,
           window: dict[str, Any] | None = None, rows: Any = None) -> dict[str, Any]:
    """Write one trainer format of the selection plus its draft vocabulary into `out`; returns the manifest.

    `counts` and `vocab` are the selection's output-token counts and draft vocabulary,
    computed once for every format (`run_export`). With `params` and 04's stored hidden states,
    the trainer's own layout is written too (`handoff.write_handoff`: hardlinked when
    `hidden.layout` is this trainer's, else converted with a disk check). An online format
    (`online.py`) needs `params` and no store. `drift`: the text trainers' count (`text_drift`),
    measured here when None and params are given. `window`: the online trainers' window of the rows at
    `export.online_max_length` (`online.window`), made here when None; `rows`: an online format's row files
    (`online.Rows`) already fed every row (`run_export`'s one pass), else written here. The rows are read from `sel`
    a chunk at a time by every file that holds them.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    require_merged_states(params, fmt)  # 04 planned a mix and merged no index: refused before anything is written
    with peers_to_log(Path(run_dir) / "export" / PEER_LOG):  # datasets' and speculators' own lines: not the notebook's
        return _export(Path(run_dir), Path(out), fmt, sel, counts, vocab, params, drift, window, rows)


def _export(run_dir: Path, out: Path, fmt: str, sel: Selection, counts: np.ndarray, vocab: DraftVocab,
            params: Any, drift: dict[str, Any] | None, window: dict[str, Any] | None, rows: Any) -> dict[str, Any]:
    """`export`'s body, the peers' logging already routed to the run's log."""
    out.mkdir(parents=True, exist_ok=True)
    if drift is None and params is not None:
        drift = text_drift.measure(params, sel)
    files: dict[str, str] = {}
    save_draft_vocab(vocab, out / "draft_vocab.safetensors")
    files["draft_vocab.safetensors"] = "d2t int64 [draft_vocab] (target_id = draft_id + d2t), t2d bool [target_vocab]"
    handoff: dict[str, Any] | str = "not written: no params given"
    if fmt in ONLINE_FORMATS:
        if params is None:
            raise ExportError(f"format {fmt}: an online hand-off needs the run's params")
        more, handoff = online.write_online(params, sel, out, fmt, vocab, counts, drift or {}, conversation, window,
                                            rows)
        files.update(more)
    else:
        trainer = get_trainer(fmt)
        for name in trainer.export_files:  # the token files this trainer takes, then its draft vocabulary
            write, holds = _TOKEN_FILES[name]
            write(out / name, sel)
            files[name] = holds
        files.update(trainer.write_export_vocab(out, vocab.d2t, vocab.t2d, counts))
        if params is not None:
            handoff = _handoff(params, sel, out, fmt, vocab)
    manifest = {
        "format": fmt,
        "run_dir": str(run_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "selection": {"mix": sel.mix_source, "verdicts_present": sel.verdicts_present,
                      "include_failed": sel.include_failed, "hidden_verification": sel.hidden_verification,
                      "rule": ("04's training mix: records that passed every audit check"
                               if sel.verdicts_present and not sel.include_failed
                               else "04's training mix, NO audit filter (no verdicts, or hidden.include_failed)")},
        "exported": len(sel),
        "ids_exact": sum(e.ids_exact for e in sel.entries),
        "ids_rebuilt": sum(not e.ids_exact for e in sel.entries),
        "tokens": sum(e.tokens for e in sel.entries),
        "output_tokens": int(counts.sum()),
        "skipped": sel.skipped_counts(),
        "skipped_samples": sel.skipped,
        "draft_vocab": vocab.summary(),
        "files": files,
        "handoff": handoff if isinstance(handoff, str) else {k: handoff[k] for k in (
            "plan", "linked_files", "converted_files", "converted_bytes", "rows", "final_state", "store_layout",
            "files", "specforge_target", "made_by", "max_length", "window", "layers", "train_command")
            if k in handoff and not (k == "files" and fmt in ONLINE_FORMATS)},  # online: its files are the manifest's
        "text_trainers": drift if drift is not None else "not measured: no params given",
    }
    write_atomic(out / "manifest.json", orjson.dumps(manifest, option=orjson.OPT_INDENT_2))  # whole or not at all
    return manifest


# ---------------------------------------------------------------- entry points


def params_of_run(run_dir: Path) -> Any:
    """The params a run folder was made with (`provenance.params_of_run`); problems are ExportErrors."""
    if not (run_dir / "records").is_dir():
        raise ExportError(f"{run_dir} has no records/ folder: is it a run folder (outputs/<run>)?")
    try:
        return read(run_dir)
    except RunParamsError as e:
        raise ExportError(str(e)) from None


@dataclass
class ExportResult:
    """What `run_export` wrote: the manifests per format, the selection, the draft vocabulary."""

    out_dir: Path
    manifests: dict[str, dict[str, Any]]
    selection: Selection
    counts: np.ndarray
    vocab: DraftVocab

    def table(self):
        """Per dataset: exported samples, exact vs rebuilt ids, output tokens, skipped by reason."""
        return self.selection.table()

    def files_table(self):
        """Every file written, with its size and what it holds."""
        import pandas as pd

        rows = []
        for fmt, m in self.manifests.items():
            ho = m.get("handoff") if isinstance(m.get("handoff"), dict) else {}
            for name, what in list(m["files"].items()) + list((ho.get("files") or {}).items()):
                size = sum(_bytes(self.out_dir / fmt, part.strip()) for part in name.split(","))
                rows.append({"format": fmt, "file": name, "bytes": size, "holds": what})
        return pd.DataFrame(rows, columns=["format", "file", "bytes", "holds"])

    def coverage_figure(self, sizes: Iterable[int] | None = None):
        """Coverage of output tokens against draft vocabulary size, the chosen size marked."""
        import matplotlib.pyplot as plt

        n = len(self.vocab.d2t)
        top = max(n, int(self.vocab.distinct_output_tokens), 2)
        sizes = sorted(set(sizes or np.unique(np.geomspace(1, top, 60).astype(int)).tolist()) | {n})
        curve = coverage_curve(self.counts, sizes)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(list(curve), [100 * v for v in curve.values()], color="tab:blue")
        ax.axvline(n, color="tab:red", ls="--", label=f"draft vocab {n}: {100 * self.vocab.coverage:.2f}%")
        ax.set_xscale("log")
        ax.set_xlabel("draft vocabulary size (most frequent output tokens)")
        ax.set_ylabel("output tokens covered (%)")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        plt.close(fig)  # shown once, as the cell's value (not again by the inline backend)
        return fig


def _bytes(folder: Path, pattern: str) -> int:
    """Bytes of the files a manifest entry names (a file, a folder `x/`, or a glob such as `data-*.arrow`).

    A symlink counts nothing (SpecForge's `target/` links to the model's files: no copy)."""
    out = 0
    for p in folder.glob(pattern.rstrip("/")):
        if p.is_symlink():
            continue
        out += sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink()) if p.is_dir() \
            else p.stat().st_size
    return out


def _handoff(params: Any, sel: Selection, out: Path, fmt: str, vocab: DraftVocab) -> dict[str, Any] | str:
    """The trainer's own layout of the mix, or why it is not written (04 has stored no hidden states)."""
    if not (hidden_dir(params) / INDEX_FILE).exists():
        return "not written: 04 has stored no hidden states (no hidden/index.parquet); token files only"
    return write_handoff(params, sel, out, fmt, vocab=vocab)


def _survey(params: Any, sel: Selection, outs: dict[str, Path]
            ) -> tuple[np.ndarray, DraftVocab, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One pass over the rows, a chunk at a time: their output-token counts and draft vocabulary, the text trainers'
    count (`text_drift`) and the online trainers' window, each made once per export for every format, and the row
    files of each online format in `outs` (format -> folder: `online.Rows`, finished by `export`)."""
    counts = np.zeros(get_profile(params.profile).vocab_size, np.int64)
    drift = text_drift.counter(params)
    win = online.Window(params.export.online_max_length, max((e.tokens for e in sel.entries), default=1))
    rows = {f: online.rows_for(f, o, sel, conversation, {"max_length": win.L}) for f, o in outs.items()
            if f in ONLINE_FORMATS}
    try:
        for chunk in sel.chunks():
            add_output_counts(counts, chunk)
            drift.add(chunk)
            win.add(chunk)
            for r in rows.values():
                r.add(chunk)
    except BaseException:
        for r in rows.values():
            r.abort()
        raise
    vocab = build_draft_vocab(counts, params.export.draft_vocab_size)
    return counts, vocab, drift.result(), win.result(), rows


def run_export(params: Any, out: str | Path | None = None, formats: Iterable[str] | None = None) -> ExportResult:
    """Export 04's mix in each format (`export.formats`) into `<run>/export/<format>/` (or `out`), plus `draft_vocab.safetensors`."""
    run_dir = params.run_dir
    out = Path(out) if out else run_dir / "export"
    formats = list(formats if formats is not None else params.export.formats)
    keep: dict[str, Any] = {}
    manifests = export_formats(params, {fmt: out / fmt for fmt in formats}, keep)
    save_draft_vocab(keep["vocab"], out / "draft_vocab.safetensors")
    write_provenance(run_dir, "05_export", params)
    return ExportResult(out_dir=out, manifests=manifests, selection=keep["sel"], counts=keep["counts"],
                        vocab=keep["vocab"])


def export_formats(params: Any, outs: dict[str, str | Path], keep: dict[str, Any] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Export 04's mix of a run in each format into its folder (`{format: folder}`, what `eagle3data export` does):
    the mix read, the draft vocabulary, the text trainers' count and the online formats' rows made in one pass over
    the rows; returns the manifests (`keep`: filled with the selection, counts and vocabulary)."""
    bad = [f for f in outs if f not in FORMATS]
    if bad:
        raise ExportError(f"unknown export format {bad[0]!r}; formats: {', '.join(FORMATS)}")
    sel = select_samples(params)
    for fmt in outs:
        require_merged_states(params, fmt)  # 04 planned a mix and merged no index: refused before anything is written
    outs = {f: Path(o) for f, o in outs.items()}
    with peers_to_log(params.run_dir / "export" / PEER_LOG):  # datasets' and speculators' own lines
        counts, vocab, drift, win, rows = _survey(params, sel, outs)
    if keep is not None:
        keep.update(sel=sel, counts=counts, vocab=vocab)
    return {fmt: export(params.run_dir, out, fmt, sel, counts, vocab, params, drift, win, rows.get(fmt))
            for fmt, out in outs.items()}


def export_format(params: Any, out: str | Path, fmt: str) -> dict[str, Any]:
    """Export 04's mix of a run in one format into `out`; returns the manifest (`export_formats` of one)."""
    return export_formats(params, {fmt: out})[fmt]


def export_cli(run: str, *, fmt: str | list[str], out: str | None = None) -> int:
    """`python -m eagle3data export RUN --format F [--format G ...] [--out DIR]`.

    One format: `--out` is its folder (default `<run>/export/<format>`). Several: each goes into
    `<out>/<format>/` (default `<run>/export/`)."""
    run_dir = Path(run)
    fmts = [fmt] if isinstance(fmt, str) else list(dict.fromkeys(fmt))
    if len(fmts) == 1:
        outs = {fmts[0]: Path(out) if out else run_dir / "export" / fmts[0]}
    else:
        outs = {f: Path(out or run_dir / "export") / f for f in fmts}
    params = params_of_run(run_dir)  # bad input raises: cli.main says it in one line
    manifests = ({fmts[0]: export_format(params, outs[fmts[0]], fmts[0])} if len(fmts) == 1
                 else export_formats(params, outs))
    m = manifests[fmts[0]]
    skipped = ", ".join(f"{k} {v}" for k, v in m["skipped"].items()) or "none"
    print(f"exported {m['exported']} samples ({m['ids_exact']} exact ids, {m['ids_rebuilt']} rebuilt), "
          f"{m['output_tokens']} output tokens -> {', '.join(str(o) for o in outs.values())}")
    print(f"skipped: {skipped}")
    if m["selection"]["hidden_verification"] not in ("passed", "no hidden states"):
        print(f"hidden states: {m['selection']['hidden_verification']}")
    dv = m["draft_vocab"]
    print(f"draft vocab {dv['draft_vocab_size']} of {dv['target_vocab_size']}: coverage {dv['coverage']:.2%}"
          + (f" ({dv['filled']} ids filled: fewer distinct output tokens than the size)" if dv["filled"] else ""))
    for f, mf in manifests.items():
        if isinstance(mf.get("handoff"), dict) and "window" in mf["handoff"]:
            print(online.window_line(f, mf["handoff"]["window"]))
    if isinstance(m.get("text_trainers"), dict):
        print(text_drift.drift_line(m["text_trainers"]))
    return 0
