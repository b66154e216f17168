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
# # 02 · Reconstruct
# Rebuilds token ids for records that came back as text from an API, proves each rebuild
# (seam check, decode roundtrip, length vs billed tokens), and measures how often
# re-tokenizing lies where the true ids are known (local / SGLang records).
#
# **Reads:** `outputs/<run>/records/<dataset>.jsonl` (never rewritten).
# **Writes:** `outputs/<run>/reconstruct/<dataset>.jsonl` (rebuilt API records, `ids_exact:
# false`), `reconstruct/summary.json`, `reconstruct/drift.json`, `provenance/02_reconstruct.json`.
# **Parameters:** `params_file` (a YAML under `params/`), `overrides` (dotted keys, as
# `-p key value` on the CLI); the stage's own keys live under `reconstruct:`.

# %%
from eagle3data.params import load_params, params_for_display
from eagle3data.reconstruct import FLAGS, run_reconstruct

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir)
params_for_display(P)["reconstruct"]

# %% [markdown]
# ## 1. Rebuild API records and measure drift on exact records

# %%
result = run_reconstruct(P)
print(f"{result.summary['api_records']} API records rebuilt; "
      f"{result.drift['overall']['n']} exact records measured for drift in {result.seconds:.1f} s")

# %% [markdown]
# ## 2. Rebuilt API records: seam, roundtrip and billed-count agreement per dataset
# `count_diff_pct` is (rebuilt − billed) / billed over the dataset; `abs_count_diff_pct`
# sums per-record differences without letting them cancel. Empty when the run has no API records.

# %%
result.table()

# %%
result.provider_table()

# %% [markdown]
# ## 3. Flags (records per flag; flags are reported, never fixed)

# %%
result.flag_table()

# %%
{k: v for k, v in FLAGS.items()}

# %% [markdown]
# ## 4. Drift: rebuilding from text vs the true ids
# Exact-match rate per dataset with its 95% Wilson interval: how far to trust the API part of
# a mixed dataset. `text_equal` counts records whose API-style text reassembles to the true
# decoded text (a mismatch there is a text split problem, not a tokenizer one).

# %%
result.drift_table()

# %% [markdown]
# ### Divergent examples, token by token (window around the first divergence)

# %%
result.drift_examples()

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
figures = {
    "api_records": result.summary["api_records"],
    "drift_records": result.drift["overall"]["n"],
    "drift_exact": result.drift["overall"]["exact"],
    "drift_exact_rate": result.drift["overall"]["rate"],
    "drift_ci95": result.drift["overall"]["ci95"],
    "drift_rate_by_dataset": {k: v["rate"] for k, v in result.drift["datasets"].items()},
}
figures
