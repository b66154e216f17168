"""The run's records as one table: journals joined, 02's rebuilt ids merged in, one record per key.

`load_run` reads every journal of a run (`idtable.read_journal`) and joins the tables
(`concat_tables`); `merge_reconstruct` fills the ids of API records from 02's
`reconstruct/<dataset>.jsonl` with each record's proof level; `supersede_lines` finds the
one record per key that the supersede rule chooses (`reader.supersede_codes` on `SampleKey.codes_of_frame`) and
lists the superseded lines; `take_records` is a table of some rows only. This is the in-memory view of a run
(the CLI, tests, small runs); 03 itself reads a run in chunks (`streamed`).
"""

from __future__ import annotations

from itertools import chain
from collections.abc import Mapping
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from eagle3data.audit.idtable import META_COLUMNS, AuditInputError, IdTable, read_journal, take_rows
from eagle3data.audit.rebuilt import RebuiltIds
from eagle3data.core.reader import COMPLETED, RunFileError, SampleKey, read_rebuilt, supersede_codes


def concat_tables(tables: Sequence[IdTable]) -> IdTable:
    """One IdTable from several (e.g. one per dataset journal)."""
    tables = [t for t in tables if t is not None]
    if not tables:
        return empty_table()
    if len(tables) == 1:
        return tables[0]

    def cat(name: str, off_name: str) -> tuple[np.ndarray, np.ndarray]:
        flats = [getattr(t, name).astype(np.int64, copy=False) for t in tables]
        offs, base = [np.zeros(1, np.int64)], 0
        for t in tables:
            o = getattr(t, off_name)
            offs.append(o[1:] + base)
            base += int(o[-1])
        return np.concatenate(flats), np.concatenate(offs)

    prompt, poff = cat("prompt", "prompt_off")
    output, ooff = cat("output", "output_off")
    t = IdTable(pd.concat([t.meta for t in tables], ignore_index=True), prompt, poff,
                np.concatenate([t.has_prompt for t in tables]), output, ooff,
                np.concatenate([t.has_output for t in tables]))
    for f in ("messages", "tools", "reasoning", "content", "loss_mask", "tool_calls"):
        if all(getattr(x, f) is not None for x in tables):
            setattr(t, f, list(chain.from_iterable(getattr(x, f) for x in tables)))
    t.bad_lines = list(chain.from_iterable(x.bad_lines for x in tables))
    t.torn_tail_bytes = sum(x.torn_tail_bytes for x in tables)
    return t


def empty_table() -> IdTable:
    z = np.zeros(1, np.int64)
    return IdTable(pd.DataFrame({c: [] for c in META_COLUMNS + ["line", "file"]}), np.zeros(0, np.int64), z,
                   np.zeros(0, bool), np.zeros(0, np.int64), z.copy(), np.zeros(0, bool))


def merge_reconstruct(table: IdTable, run_dir: str | Path, rebuilt: Mapping[SampleKey, dict] | None = None) -> IdTable:
    """Fill ids of API records (output_ids null) from 02's `reconstruct/<dataset>.jsonl` (`reader.read_rebuilt`,
    or `rebuilt`: 02's lines by key, e.g. `rebuilt.RebuiltIds`, whose ids are arrays read when asked for).

    Adds the meta columns `ids_from` (`journal`, `reconstruct`, or `none`) and `proof_level`
    (`engine` for exact journal ids, 02's level for rebuilt ids, `journal` for journal ids
    not marked exact, `none` without ids, `unknown` for a rebuilt line without a level). A missing
    reconstruct file leaves the record without ids (check `record.has_ids`); a malformed one
    is an AuditInputError naming its file and line.
    """
    meta = table.meta
    ids_from = np.where(table.has_output, "journal", "none").astype(object)
    exact = np.asarray(meta["ids_exact"].to_numpy() == True) if "ids_exact" in meta else False  # noqa: E712 (None: no)
    proof = np.where(table.has_output & exact, "engine", np.where(table.has_output, "journal", "none")).astype(object)
    meta["ids_from"], meta["proof_level"] = ids_from.astype(str), proof.astype(str)
    need = np.flatnonzero(~table.has_output)
    if len(need) == 0:
        return table
    try:
        if rebuilt is None:
            rebuilt = read_rebuilt(run_dir, [str(d) for d in meta["dataset"].iloc[need].unique()])
        keys = SampleKey.of_frame(meta.iloc[need])
        if isinstance(rebuilt, RebuiltIds):  # the keys 02 wrote, their ids parsed in one pass
            there = [(i, k) for i, k in zip(need, keys) if k in rebuilt]
            found = list(zip([i for i, _ in there], rebuilt.many([k for _, k in there])))
        else:
            found = [(i, rebuilt.get(key)) for i, key in zip(need, keys)]
    except RunFileError as e:
        raise AuditInputError(str(e)) from None
    if all(o is None for _, o in found):
        return table
    outs = [table.output_ids(i) for i in range(len(table))]
    prompts = [table.prompt_ids(i) for i in range(len(table))]
    has_o, has_p = table.has_output.copy(), table.has_prompt.copy()
    for i, o in found:  # the rows that need ids only
        if o is None or not isinstance(o.get("output_ids"), (list, np.ndarray)):
            continue
        outs[i] = np.asarray(o["output_ids"], dtype=np.int64)
        has_o[i] = True
        if isinstance(o.get("prompt_ids"), (list, np.ndarray)):
            prompts[i] = np.asarray(o["prompt_ids"], dtype=np.int64)
            has_p[i] = True
        if table.loss_mask is not None:
            table.loss_mask[i] = o.get("loss_mask")
        ids_from[i], proof[i] = "reconstruct", o.get("proof_level") or "unknown"
    meta["ids_from"], meta["proof_level"] = ids_from.astype(str), proof.astype(str)
    for name, off_name, segs in (("output", "output_off", outs), ("prompt", "prompt_off", prompts)):
        lens = np.fromiter((len(s) for s in segs), np.int64, count=len(segs))
        off = np.zeros(len(segs) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        setattr(table, name, np.concatenate([s.astype(np.int64, copy=False) for s in segs])
                if segs else np.zeros(0, np.int64))
        setattr(table, off_name, off)
    table.has_output, table.has_prompt = has_o, has_p
    return table


def take_records(table: IdTable, rows: np.ndarray) -> IdTable:
    """The table of the given rows only (ids, metadata and text fields)."""
    rows = np.asarray(rows, np.int64)
    t = IdTable(table.meta.iloc[rows].reset_index(drop=True),
                *take_rows(table.prompt, table.prompt_off, table.has_prompt, rows),
                *take_rows(table.output, table.output_off, table.has_output, rows))
    for f in ("messages", "tools", "reasoning", "content", "loss_mask", "tool_calls"):
        v = getattr(table, f)
        if v is not None:
            setattr(t, f, [v[i] for i in rows.tolist()])
    t.bad_lines, t.torn_tail_bytes = table.bad_lines, table.torn_tail_bytes
    return t


def supersede_lines(meta: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """The supersede rule on a table's lines (`reader.supersede_codes` on `SampleKey.codes_of_frame`):
    (the rows of the records, one per key, in order; per record whether its key completed twice; the
    superseded lines: dataset, sample_id, finish_reason, file, line, and the line of the record that replaced
    each, `record_line`). Needs only the lines' keys and finish reasons: nothing here works row by row.
    """
    codes = SampleKey.codes_of_frame(meta)
    is_record, dup = supersede_codes(codes, meta["finish_reason"].isin(COMPLETED).to_numpy(dtype=bool))
    rec_rows = np.flatnonzero(is_record)
    old_rows = np.flatnonzero(~is_record)
    cols = ["dataset", "sample_id", "finish_reason", "file", "line"]
    sup = meta.iloc[old_rows][[c for c in cols if c in meta]].reset_index(drop=True)
    if len(old_rows) == 0:
        sup["record_line"] = pd.Series(dtype=object)
    elif "line" in meta:
        record_of = np.zeros(int(codes.max()) + 1, np.int64)
        record_of[codes[rec_rows]] = rec_rows
        sup["record_line"] = meta["line"].to_numpy()[record_of[codes[old_rows]]]
    else:
        sup["record_line"] = None
    return rec_rows, dup[rec_rows], sup


def load_run(run_dir: str | Path, *, source_fields: bool = False) -> IdTable:
    """Every journal line of a run (`records/*.jsonl`), with 02's rebuilt ids merged in where present."""
    paths = sorted((Path(run_dir) / "records").glob("*.jsonl"))
    t = concat_tables([read_journal(p, source_fields=source_fields) for p in paths])
    return merge_reconstruct(t, run_dir)
