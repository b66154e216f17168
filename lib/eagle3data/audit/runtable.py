"""The run's records as one table: journals joined, 02's rebuilt ids merged in, one record per key.

`load_run` reads every journal of a run (`idtable.read_journal`) and joins the tables
(`concat_tables`); `merge_reconstruct` fills the ids of API records from 02's
`reconstruct/<dataset>.jsonl` with each record's proof level; `split_superseded` keeps the
one record per key that the supersede rule chooses (`reader.supersede_codes` on `SampleKey.codes_of_frame`) and
lists the superseded lines; `take_records` is a table of some rows only.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from eagle3data.audit.idtable import META_COLUMNS, AuditInputError, IdTable, read_journal, take_rows
from eagle3data.core.reader import COMPLETED, RunFileError, SampleKey, read_rebuilt, supersede_codes


def concat_tables(tables: Sequence[IdTable]) -> IdTable:
    """One IdTable from several (e.g. one per dataset journal)."""
    tables = [t for t in tables if t is not None]
    if not tables:
        return _empty_table()
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


def _empty_table() -> IdTable:
    z = np.zeros(1, np.int64)
    return IdTable(pd.DataFrame({c: [] for c in META_COLUMNS + ["line", "file"]}), np.zeros(0, np.int64), z,
                   np.zeros(0, bool), np.zeros(0, np.int64), z.copy(), np.zeros(0, bool))


def merge_reconstruct(table: IdTable, run_dir: str | Path) -> IdTable:
    """Fill ids of API records (output_ids null) from 02's `reconstruct/<dataset>.jsonl` (`reader.read_rebuilt`).

    Adds the meta columns `ids_from` (`journal`, `reconstruct`, or `none`) and `proof_level`
    (`engine` for exact journal ids, 02's level for rebuilt ids, `journal` for journal ids
    not marked exact, `none` without ids, `unknown` for a rebuilt line without a level). A missing
    reconstruct file leaves the record without ids (check `record.has_ids`); a malformed one
    is an AuditInputError naming its file and line.
    """
    meta = table.meta
    meta["ids_from"] = np.where(table.has_output, "journal", "none")
    exact = np.asarray(meta["ids_exact"].to_numpy() == True) if "ids_exact" in meta else False  # noqa: E712 (None: no)
    meta["proof_level"] = np.where(table.has_output & exact, "engine", np.where(table.has_output, "journal", "none"))
    need = np.flatnonzero(~table.has_output)
    if len(need) == 0:
        return table
    try:
        rebuilt = read_rebuilt(run_dir, [str(d) for d in meta["dataset"].iloc[need].unique()])
    except RunFileError as e:
        raise AuditInputError(str(e)) from None
    if not rebuilt:
        return table
    outs = [table.output_ids(i) for i in range(len(table))]
    prompts = [table.prompt_ids(i) for i in range(len(table))]
    has_o, has_p = table.has_output.copy(), table.has_prompt.copy()
    for i, key in zip(need, SampleKey.of_frame(meta.iloc[need])):  # keys of the rows that need ids only
        o = rebuilt.get(key)
        if o is None or not isinstance(o.get("output_ids"), list):
            continue
        outs[i] = np.asarray(o["output_ids"], dtype=np.int64)
        has_o[i] = True
        if isinstance(o.get("prompt_ids"), list):
            prompts[i] = np.asarray(o["prompt_ids"], dtype=np.int64)
            has_p[i] = True
        if table.loss_mask is not None:
            table.loss_mask[i] = o.get("loss_mask")
        meta.at[i, "ids_from"] = "reconstruct"
        meta.at[i, "proof_level"] = o.get("proof_level") or "unknown"
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


def split_superseded(table: IdTable) -> tuple[IdTable, pd.DataFrame]:
    """(the records: one row per key by `reader.supersede_codes`, with meta column `duplicate`; the superseded lines).

    The superseded frame lists each replaced line (dataset, sample_id, finish_reason, file,
    line) and the line of the record that replaced it (`record_line`). Keys are coded once
    (`SampleKey.codes_of_frame`); nothing here works row by row.
    """
    m = table.meta
    codes = SampleKey.codes_of_frame(m)
    is_record, dup = supersede_codes(codes, m["finish_reason"].isin(COMPLETED).to_numpy(dtype=bool))
    rec_rows = np.flatnonzero(is_record)
    old_rows = np.flatnonzero(~is_record)
    cols = ["dataset", "sample_id", "finish_reason", "file", "line"]
    sup = m.iloc[old_rows][[c for c in cols if c in m]].reset_index(drop=True)
    if len(old_rows) == 0:
        sup["record_line"] = pd.Series(dtype=object)
        table.meta["duplicate"] = dup
        return table, sup
    if "line" in m:
        record_of = np.zeros(int(codes.max()) + 1, np.int64)
        record_of[codes[rec_rows]] = rec_rows
        sup["record_line"] = m["line"].to_numpy()[record_of[codes[old_rows]]]
    else:
        sup["record_line"] = None
    out = take_records(table, rec_rows)
    out.meta["duplicate"] = dup[rec_rows]
    return out, sup


def load_run(run_dir: str | Path, *, source_fields: bool = False) -> IdTable:
    """Every journal line of a run (`records/*.jsonl`), with 02's rebuilt ids merged in where present."""
    paths = sorted((Path(run_dir) / "records").glob("*.jsonl"))
    t = concat_tables([read_journal(p, source_fields=source_fields) for p in paths])
    return merge_reconstruct(t, run_dir)
