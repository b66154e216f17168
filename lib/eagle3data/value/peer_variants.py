"""06's peer variants (issue 60): the run's training rows as a peer trainer's own text path makes them, put where 02
puts rebuilt ids, so that 04 and 05 make them a hand-off as for every other variant (value/variants.py).

- `text_rule`: TorchSpec's rule: the target's template as text, its assistant mask (`value.text_rule.text_rule_rows`;
  Model-Optimizer's default supervises every token: `peer="modelopt"` there);
- `template_other`: SpecForge 0.2.0's `data.train_data_path` path with its `qwen` template
  (`value.template_other.template_other_rows`).

`peer_run` writes the variant's run folder from exact's training samples (their keys in exact's order; the held-out
conversations are never among them): `records/<dataset>.jsonl`, each record as an API run writes it (no ids:
`api_records`, the text the peer read; 06's other API-text variants use it too), and `reconstruct/<dataset>.jsonl`, one line per row in the shape 02
writes, which `core.reader.resolve` and 04's mix read for a record without ids:

- the key's fields (`dataset`, `sample_id`, `turn`), `source` `api`, `provider` the variant, `finish_reason`;
- `input_ids` and `loss_mask`: the peer's row as it is (its mask may supervise several assistant turns and the
  template's tokens: no prompt/output split, so no `prompt_ids`/`output_ids`, which only 03 reads);
- `ids_exact` false and `proof_level` `text`: 02 proved nothing of them, and `text` (the ids spell the rendered
  conversation) is the level 04 takes with `hidden.min_proof_level: text`, which `variants.variant_params` sets;
- `made_by`: whose text path made them, and `kind`: the row's ids against the exact ids (`peer_rows.KINDS`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import orjson

from eagle3data.core.atomic import atomic_path
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import RunParams
from eagle3data.core.profiles import get_profile
from eagle3data.core.reader import Sample, read_run
from eagle3data.value import template_other, text_rule
from eagle3data.value.peer_rows import KINDS, PeerRow
from eagle3data.value.template_other import template_other_rows
from eagle3data.value.text_rule import text_rule_rows
from eagle3data.value.train import ValueStageError

PEER_VARIANTS = ("text_rule", "template_other")
MADE_BY = {"text_rule": text_rule.MADE_BY, "template_other": template_other.MADE_BY}
PROOF_LEVEL = "text"  # not proven by 02: the level 04 keeps with hidden.min_proof_level text
CHUNK = 256  # samples turned into rows and written at a time


def made_by(variant: str) -> str:
    """Whose text path made a peer variant's rows (the reconstruct lines' `made_by`)."""
    if variant in PEER_VARIANTS:
        return f"not 02: a peer's text path made these ids and mask: {MADE_BY[variant]}"
    raise ValueError(f"{variant!r} is not a peer variant ({', '.join(PEER_VARIANTS)})")


def peer_rows(variant: str, tokenizer: Any, profile: Any, samples: Sequence[Sample], *,
              max_length: int | None = None) -> list[PeerRow]:
    """The peer's rows of these samples (with their records). `max_length`: SpecForge's `data.max_length`
    (template_other; the text rule cuts nothing)."""
    if variant == "text_rule":
        return text_rule_rows(tokenizer, profile, samples)
    if variant == "template_other":
        return template_other_rows(tokenizer, profile, samples, max_length=max_length)
    raise ValueError(f"{variant!r} is not a peer variant ({', '.join(PEER_VARIANTS)})")


def training_samples(params: RunParams, train_keys: list[str]) -> list[Sample]:
    """The run's samples of `train_keys`, in that order, each with its record (the conversation a peer reads)."""
    view = read_run(params.run_dir, [d.name for d in params.datasets], verdicts=False)
    by = {str(k): s for k, s in view.samples(keep_record=True).items()}
    missing = [k for k in train_keys if k not in by]
    if missing:
        raise ValueStageError(f"{params.run_dir / 'records'}: {len(missing)} training row(s) of the hand-off have no "
                              f"completed record with ids in the run, first {missing[0]}")
    return [by[k] for k in train_keys]


def peer_line(variant: str, row: PeerRow, rec: dict[str, Any], by: str) -> dict[str, Any]:
    """A peer row as a `reconstruct/<dataset>.jsonl` line (module docstring)."""
    turn = {"turn": rec["turn"]} if rec.get("turn") is not None else {}
    return {"dataset": rec["dataset"], "sample_id": rec["sample_id"], **turn, "source": "api", "provider": variant,
            "ids_exact": False, "proof_level": PROOF_LEVEL, "input_ids": list(row.input_ids),
            "loss_mask": list(row.loss_mask), "finish_reason": rec["finish_reason"], "kind": row.kind, "made_by": by}


def api_records(recs: list[dict[str, Any]], texts: list[Any], provider: str) -> list[dict[str, Any]]:
    """Records as an API run writes them: text fields, no ids (02 rebuilds them)."""
    out = []
    for r, t in zip(recs, texts):
        a = {k: v for k, v in r.items() if k not in ("prompt_ids", "output_ids", "ids_exact", "logprobs")}
        a |= {"source": "api", "provider": provider, "reasoning": t["reasoning"], "content": t["content"],
              "tool_calls": t["tool_calls"], "finish_reason": t["finish_reason"], "usage": t["usage"]}
        out.append(a)
    return out


def peer_run(params: RunParams, variant: str, train_keys: list[str], vrun: Path,
             say: Callable[[str], None]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Write the variant's `reconstruct/<dataset>.jsonl` (each file through a temp name) from exact's training samples
    in exact's order, `CHUNK` at a time; return its records per dataset (as an API run writes them, for
    `records/`) and what it made: rows, their `kinds` (every one of KINDS, 0 where none), how many differ from
    exact's ids, the loss tokens of both."""

    t0 = time.monotonic()
    samples = training_samples(params, train_keys)
    tok, profile, by = tokenizer_for(params), get_profile(params.profile), made_by(variant)
    say(f"{variant}: exact's {len(samples):,} training rows through the peer's text path, written where 02 writes "
        "rebuilt ids")
    kinds = dict.fromkeys(KINDS, 0)
    differ = loss = exact_loss = 0
    records: dict[str, list[dict[str, Any]]] = {}
    (vrun / "reconstruct").mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as files:
        out: dict[str, Any] = {}
        for i in range(0, len(samples), CHUNK):
            chunk = samples[i:i + CHUNK]
            rows = peer_rows(variant, tok, profile, chunk, max_length=params.model.max_context)
            if [str(r.key) for r in rows] != [str(s.key) for s in chunk]:
                raise ValueStageError(f"{variant}: the peer's rows are not one per sample in order")
            for s, r in zip(chunk, rows):
                rec = s.record
                name = rec["dataset"]
                if name not in out:
                    out[name] = open(files.enter_context(atomic_path(vrun / "reconstruct" / f"{name}.jsonl")), "wb")
                    files.callback(out[name].close)
                out[name].write(orjson.dumps(peer_line(variant, r, rec, by)) + b"\n")
                records.setdefault(name, []).extend(api_records(
                    [rec], [{"reasoning": rec.get("reasoning"), "content": rec.get("content"),
                             "tool_calls": rec.get("tool_calls"), "finish_reason": rec["finish_reason"],
                             "usage": rec.get("usage")}], variant))
                kinds[r.kind] += 1
                differ += list(r.input_ids) != list(s.input_ids)
                loss, exact_loss = loss + sum(r.loss_mask), exact_loss + sum(s.loss_mask)
    info = {"rows": len(samples), "kinds": kinds, "ids_differ": differ, "loss_tokens": loss,
            "exact_loss_tokens": exact_loss, "made_by": by, "seconds": round(time.monotonic() - t0, 1)}
    return records, info
