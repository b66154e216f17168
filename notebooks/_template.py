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
# # NN · Stage name

# %% [markdown] tags=["notebook-only"]
# **Reads:** … **Writes:** `outputs/<run>/…` **Parameters:** `params_file` (a YAML under
# `params/`), `overrides` (dotted keys, as `-p key value` on the CLI).

# %%
from eagle3data.core.params import load_params

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
P.run_dir

# %% [markdown]
# ## 1. First step

# %%

# %% [markdown]
# ## Figures recorded for tests and the report

# %%
