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
# # 04 · Extract hidden states
# Plans once (the training mix built with the model's context limit, the layers, the estimate),
# then executes that plan: stores the target's EAGLE-3 states for every token of every mix
# sample: the outputs of three decoder layers (profile rule) and the final state
# (`hidden.final_state`: the last layer's pre-norm output for speculators, the post-norm state for
# SpecForge, or both), in shards or in a trainer's own per-sample files (`hidden.layout`).
#
# **Reads:** `outputs/<run>/records/*.jsonl` (01), `reconstruct/<dataset>.jsonl` (02, rebuilt ids of
# API records), `audit/verdicts.jsonl` (03; when absent no audit filter is applied, and the
# manifest says so). **Writes:** `outputs/<run>/hidden/` (or `hidden.out_dir`): `mix.parquet`,
# `mix_manifest.json`, `shards/*.safetensors`, `index.parquet`, `index.json`, `verify.jsonl`, `verify_summary.json`;
# `provenance/04_extract_hidden.json`. **Parameters:** `params_file` (a YAML under `params/`),
# `overrides` (dotted keys, as `-p key value` on the CLI); the stage's settings are the
# `hidden:` section. Resumable: finished shards are kept. Several GPUs: `docs/04_extract_hidden.md`.

# %%
from eagle3data.hidden.extract import plan_extract, run_extract
from eagle3data.hidden.store.reader import HiddenReader
from eagle3data.core.params import load_params, params_for_display

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir)
params_for_display(P)["hidden"]

# %% [markdown]
# ## 1. The plan: mix, layers, estimate (made once)
# `plan_extract` builds the training mix with the model's context limit and writes it (once),
# takes the layers from the model's config, finds what finished shards already hold, sizes what
# is left and, with work to do, loads the model and times a probe. Section 4 executes exactly
# this plan: `python -m eagle3data extract` calls the same two functions, without the tables.

# %%
plan = plan_extract(P)
print(plan.mix.manifest["audit_note"])
print(plan.context_line())
plan.mix.table()

# %% [markdown]
# Shares per dataset when `hidden.dataset_weights` is set (empty otherwise): the largest mix that
# holds them without repeating a sample.

# %%
plan.mix.weights_table()

# %% [markdown]
# What is dropped and why (`too_long`: longer than the context limit above, never truncated).

# %%
plan.mix.dropped_table()

# %% [markdown]
# ## 2. Layers captured (both conventions name the same tensors)

# %%
print(plan.layers_line())

# %% [markdown]
# ## 3. Size and time estimate (the run refuses to start if the disk lacks room)

# %%
plan.estimate.table()

# %% [markdown]
# ## 4. Extract the plan (resumes: samples in finished shards are skipped)

# %%
res = run_extract(P, plan=plan)
res.stats_table()

# %% [markdown]
# ## 5. Sequences beyond the model's context (dropped from the mix, never extracted or truncated)

# %%
res.too_long_table()

# %% [markdown]
# ## 6. Stored per dataset

# %%
res.table()

# %% [markdown]
# ## 7. Validation: shapes, NaN/Inf, ids and mask equal to the source records, coverage

# %%
res.validation.summary() if res.validation else f"not merged yet: {res.waiting_for} samples of other workers missing"

# %%
res.validation.table() if res.validation else None

# %% [markdown]
# ## 8. Verify: the stored states are the target's own
# `verify_store` (what `python -m eagle3data verify-hidden RUN` runs; 04 runs it at its end when
# `hidden.verify_after`): the target's head on the final state (per sample, the record token's
# logit z at sampled output and prompt positions; over the run, top-1 and log-prob through the
# whole head), no NaN / flat rows / duplicate layers, the final state's kind (pre- vs post-norm),
# the per-layer norm profile against the run's own samples, and
# `hidden.verify_recompute` samples per shard run through the target again and compared
# element-wise. 05 refuses a store that has not passed (unless `export.allow_unverified`).
# Per-sample lines: `hidden/verify.jsonl`; counts and bounds: `hidden/verify_summary.json`.

# %%
ver = res.verification
print(ver.line() if ver else "not verified here (hidden.verify_after false, or the index is not merged yet)")
ver.table() if ver else None

# %%
ver.failed_table() if ver else None

# %% [markdown]
# ## 9. Reading one sample back (what a trainer does)
# Its index row, then each tensor's shape and dtype. The row's `checksum` is its file's content checksum
# (XXH3-128 over the stored bytes: float states, which another CPU rounds differently in the last bits), so it
# proves a copy of this store, not that two machines computed the same states; the ids, masks and shapes do.

# %%
reader = HiddenReader(res.hidden_dir) if res.merged else None  # a stopped run has no index yet
one = reader.sample(0) if reader else {}
{k: (tuple(v.shape), str(v.dtype)) if hasattr(v, "shape") else v for k, v in one.items()}

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
figures = res.figures()
figures
