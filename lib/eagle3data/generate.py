"""Stage 01: run prompt datasets through the target and journal the exact token ids.

`run_generate(params)` templates every prompt with the profile's options, skips samples the
journal already holds (resume keyed by `(dataset, sample_id)`), generates with the backend
named in params, appends one record per response as it completes, and keeps
`outputs/<run>/ledger.json` up to date.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .params import RunParams
from .profiles import get_profile
from .prompts import Prompt, load_datasets, template_prompt
from .records import Journal, Record, Usage, record_key, scan_journal


@dataclass
class DatasetLedger:
    """Per-dataset counts: the damage assessment of a run, kept current while it runs."""

    planned: int = 0
    done: int = 0
    errors: int = 0
    skipped: int = 0
    in_flight: int = 0
    resumed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    by_provider: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped_ids: list[Any] = field(default_factory=list)
    cancelled_ids: list[Any] = field(default_factory=list)
    rejected_prompt_lines: list[str] = field(default_factory=list)


def write_ledger(run_dir: Path, ledger: dict[str, DatasetLedger], status: str, extra: dict | None = None) -> None:
    """Write `ledger.json` atomically (write a temp file, then rename)."""
    data = {"status": status, "updated_at": time.time(),
            "datasets": {k: v.__dict__ for k, v in ledger.items()}}
    if extra:
        data.update(extra)
    tmp = run_dir / "ledger.json.tmp"
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    tmp.replace(run_dir / "ledger.json")


def read_ledger(run_dir: str | Path) -> dict[str, Any] | None:
    p = Path(run_dir) / "ledger.json"
    return orjson.loads(p.read_bytes()) if p.exists() else None


def _sampling_dict(params: RunParams) -> dict[str, Any]:
    return params.generate.sampling.model_dump(exclude_none=True)


def _local_record(params: RunParams, prompt: Prompt, prompt_ids: list[int], res: dict[str, Any],
                  profile: Any, tokenizer: Any) -> Record:
    from .backends.local import texts_from_ids

    reasoning, content = texts_from_ids(res["output_ids"], profile, tokenizer)
    return Record(
        dataset=prompt.dataset, sample_id=prompt.sample_id, source="local", model=params.model.name,
        profile=profile.name, messages=prompt.messages, tools=prompt.tools, prompt_ids=prompt_ids,
        output_ids=res["output_ids"], ids_exact=True, reasoning=reasoning, content=content,
        finish_reason=res["finish_reason"],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(res["output_ids"])),
        sampling=_sampling_dict(params), latency_s=round(res["latency_s"], 4), created_at=time.time(),
    )


@dataclass
class GenerateSummary:
    run_dir: Path
    ledger: dict[str, DatasetLedger]
    seconds: float
    new_records: int

    def table(self):
        import pandas as pd

        rows = [{"dataset": k, **{c: getattr(v, c) for c in
                 ("planned", "done", "resumed", "errors", "skipped", "prompt_tokens", "completion_tokens")}}
                for k, v in self.ledger.items()]
        return pd.DataFrame(rows).set_index("dataset")


def run_generate(params: RunParams, *, progress: bool = True, model: Any = None, tokenizer: Any = None) -> GenerateSummary:
    """Generate every pending sample of the run with the local backend; journal as it goes."""
    from tqdm.auto import tqdm

    from .backends.local import LocalBackend
    from .models import model_for, tokenizer_for
    from .provenance import write_provenance

    if params.generate.backend != "local":
        raise NotImplementedError(f"backend {params.generate.backend!r} is not available in this build")
    t0 = time.perf_counter()
    profile = get_profile(params.profile)
    tokenizer = tokenizer or tokenizer_for(params)
    run_dir = params.run_dir
    (run_dir / "records").mkdir(parents=True, exist_ok=True)
    write_provenance(run_dir, "01_generate", params)
    sets = load_datasets(params)

    ledger: dict[str, DatasetLedger] = {}
    pending: list[tuple[Prompt, list[int]]] = []
    for name, ps in sets.items():
        led = ledger[name] = DatasetLedger(planned=len(ps.prompts), rejected_prompt_lines=ps.skipped)
        scan = scan_journal(run_dir / "records" / f"{name}.jsonl", repair=True)
        done = {record_key(r) for r in scan.records if r["finish_reason"] != "error" or not params.generate.retry_errors}
        led.resumed = len(done)
        led.done = sum(1 for r in scan.records if r["finish_reason"] != "error")
        led.errors = len(scan.records) - led.done
        for p in ps.prompts:
            if (name, str(p.sample_id)) not in done:
                pending.append((p, template_prompt(tokenizer, p, profile)))
    write_ledger(run_dir, ledger, "running")

    new = 0
    if pending:
        model = model or model_for(params)
        backend = LocalBackend(model, tokenizer, profile, params.generate.sampling, params.generate.batch_size)
        # similar lengths together: less padding per batch
        pending.sort(key=lambda x: len(x[1]))
        journals: dict[str, Journal] = {}
        bar = tqdm(total=len(pending), desc="generate", unit="sample", disable=not progress)
        try:
            bs = params.generate.batch_size
            for i in range(0, len(pending), bs):
                chunk = pending[i : i + bs]
                results = backend.generate_batch([ids for _, ids in chunk])
                for (p, ids), res in zip(chunk, results):
                    rec = _local_record(params, p, ids, res, profile, tokenizer)
                    j = journals.get(p.dataset) or journals.setdefault(
                        p.dataset, Journal(run_dir / "records" / f"{p.dataset}.jsonl"))
                    j.write(rec)
                    led = ledger[p.dataset]
                    led.done += 1
                    led.prompt_tokens += len(ids)
                    led.completion_tokens += len(res["output_ids"])
                    new += 1
                bar.update(len(chunk))
                write_ledger(run_dir, ledger, "running")
        finally:
            bar.close()
            for j in journals.values():
                j.close()
    write_ledger(run_dir, ledger, "finished")
    return GenerateSummary(run_dir, ledger, time.perf_counter() - t0, new)
