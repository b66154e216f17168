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
# # 01 · Generate
# Runs each prompt dataset through the target and journals the exact token ids.
#
# **Reads:** the prompt sets named in params (`builtin:` sets ship with the package).
# **Writes:** `outputs/<run>/records/<dataset>.jsonl` (one record per response, appended as
# it completes, never rewritten), `outputs/<run>/ledger.json`, `provenance/01_generate.json`.
# **Parameters:** `params_file` (a YAML under `params/`), `overrides` (dotted keys, as
# `-p key value` on the CLI). API keys are never parameters: params name the environment
# variable that holds one.

# %%
from eagle3data.generate import run_generate
from eagle3data.params import load_params, params_for_display

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir)
params_for_display(P)["generate"]

# %% [markdown]
# ## 1. Generate (resumes: samples already in the journal are skipped)

# %%
summary = run_generate(P)

# %% [markdown]
# ## 2. Ledger: planned, done, errors, skipped per dataset

# %%
summary.table()

# %% [markdown]
# ## Figures recorded for tests and the report

# %%
figures = {"records": int(summary.table()["done"].sum()), "new_records": summary.new_records}
figures
