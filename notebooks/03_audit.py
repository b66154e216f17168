# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: eagle3data
#     language: python
#     name: eagle3data
# ---

# %% [markdown]
# # 03 · Audit
# Checks every record's token structure, prompt and text against the model profile, and says
# how far the result can be trusted (a check that saw zero failures in *n* records only bounds
# the failure rate below 3/*n* at 95 %).

# %% [markdown] tags=["notebook-only"]
# **Reads:** `outputs/<run>/records/*.jsonl`, `reconstruct/<dataset>.jsonl` (02's rebuilt ids for
# API records, when present), `ledger.json`.
# **Writes:** `outputs/<run>/audit/verdicts.jsonl` (one line per record: dataset, sample_id, failed
# and flagging check names, truncated), `audit/summary.json`, `provenance/03_audit.json`; `make run` renders
# this notebook, without code and without this cell (tag `notebook-only`), as `outputs/<run>/report.html`,
# under a summary of the run.
# **Parameters:** `params_file`, `overrides` (dotted keys, as `-p key value` on the CLI),
# `sample_id` and `dataset`: the record the inspector opens (None = `audit.inspect_*` in params).

# %%
from eagle3data.audit import plots
from eagle3data.audit.run import run_audit
from eagle3data.generate.ledger import ledger_frame
from eagle3data.audit.inspector import failing_records, inspect_record
from eagle3data.core.models import tokenizer_for
from eagle3data.core.params import load_params
from eagle3data.audit.report import (HTMLBlock, audit_banners, check_matrix_html, check_summary_view, params_html, shown_path,
                               show_table, superseded_html)

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}
sample_id = None
dataset = None

# %%
P = load_params(params_file, overrides)
tok = tokenizer_for(P)
result = run_audit(P, progress=False, tokenizer=tok)
s = result.summary()
HTMLBlock(f"<p>Run <b>{P.run_name}</b> ({shown_path(P.run_dir)}), profile <b>{P.profile}</b>: {s['records']} records, "
          f"{s['output_tokens']:,} output tokens audited in {s['seconds']:.2f} s; <b>{s['records_failed']}</b> "
          f"records failed a check, {s['records_flagged']} flagged and kept (audit.flag_only), "
          f"{s['records_truncated']} truncated (finish_reason length). "
          f"Notes: {'; '.join(s['notes']) or 'none'}.</p>" + audit_banners(result).html)

# %% [markdown]
# ## 1. Run parameters
# As loaded and validated (params never hold secrets: they name the environment variable of a key).

# %%
params_html(P)

# %% [markdown]
# ## 2. Ledger: the damage assessment from 01_generate
# Planned, done, errors, skipped (budget or context) and cancelled samples per dataset, with cost.
# The plot compares the prompt lengths of done, skipped and cancelled samples: if a budget cut
# skipped mostly long prompts, the data is biased towards short ones and this shows it.

# %%
show_table(ledger_frame(result.ledger), "ledger-table")

# %%
plots.prompt_length_bias(result.skipped_lengths)

# %% [markdown]
# ## 3. Checks: honest numbers
# One row per check over all records. `applicable` counts records the check applies to (truncated
# records are exempt from the end-of-turn checks; reasoning and tool-call checks are `n/a` for a
# profile without those tokens; tokenizer checks are `not run` without a tokenizer). Where a check
# saw zero failures, `upper95` is the rule-of-three bound 3/n on its failure rate (as a percentage,
# like the verdict), and `records_for_0.1%` is how many records would bound it below 0.1 %.
# A check named in `audit.flag_only` (default: `text.roundtrip`) flags a record instead of failing it:
# counted, bounded and shown, and the record stays in the training mix.

# %%
show_table(check_summary_view(result), "check-table")

# %% [markdown]
# Per dataset × source × provider: records, truncated, errors and records with any failure. Then
# the check matrix, which shows only what informs: the checks that failed, flagged (or were not run)
# somewhere, as `FAIL k/n (rate)`, `flagged k/n (rate)` or `0/n` per group, and one column bounding every other check
# of the group at once.

# %%
show_table(result.group_table(), "group-table")

# %%
check_matrix_html(result)

# %% [markdown]
# Journal lines superseded by a later line of the same sample (a retried error): shown for the
# record, never counted as a failure or a duplicate. Nothing shows when there are none.

# %%
superseded_html(result)

# %% [markdown]
# ## 4. Plots
# Token lengths per dataset; where the special tokens sit in each output (an outlier stands out
# at a glance: a reasoning-close late in the output, an end-of-turn before the end, a tool-call
# section inside reasoning); finish reasons per dataset; failures per check.

# %%
plots.length_distributions(result)

# %%
plots.special_positions(result)

# %%
plots.finish_reasons(result)

# %%
plots.check_failures(result)

# %% [markdown]
# ## 5. Inspector
# One record: its prompt messages by role, the decoded output with every special token marked,
# the full templated sequence with the trained (loss-mask) span shaded, where the special tokens
# sit, and every check's verdict.

# %%
ds, sid = (dataset, sample_id) if sample_id is not None else (P.audit.inspect_dataset, P.audit.inspect_sample_id)
inspect_record(result, ds, sid, tok)

# %% [markdown]
# ## 6. Failing records
# The first few records of each failed or flagging check (`audit.failing_examples` per check), in the inspector.

# %%
views = failing_records(result, tok, P.audit.failing_examples)
HTMLBlock("".join(v.html for v in views) or ("<p><b>No record failed or was flagged by a check.</b></p>" if s["records"]
                                              else "<p><b>No records to show: the run holds none.</b></p>"))

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of `report.html` and the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
figures = {"records": s["records"], "records_failed": s["records_failed"], "truncated": s["records_truncated"],
           "output_tokens": s["output_tokens"], "seconds": s["seconds"],
           "failed_checks": {k: v["failed"] for k, v in s["checks"].items() if v["failed"]},
           "records_flagged": s["records_flagged"],
           "flagged_checks": {k: v["flagged"] for k, v in s["checks"].items() if v["flagged"]}}
figures
