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
# Runs each prompt dataset through the target and journals every response as it completes:
# in process (`local`), through SGLang's native `/generate` (`sglang`, exact ids), or through
# an OpenAI-compatible API such as OpenRouter (`openai`, text; 02 rebuilds the ids).
#
# **Reads:** the prompt sets named in params (`builtin:` sets ship with the package).
# **Writes:** `outputs/<run>/records/<dataset>.jsonl` (one record per response, appended as
# it completes, never rewritten), `outputs/<run>/ledger.json` (planned / done / errors /
# skipped / cancelled, tokens and cost per dataset, source and provider; rewritten while it
# runs), `provenance/01_generate.json`.
# **Parameters:** `params_file` (a YAML under `params/`), `overrides` (dotted keys, as
# `-p key value` on the CLI). API keys are never parameters: params name the environment
# variable that holds one.
#
# Re-running resumes: samples already in the journal are skipped (a torn last line left by a
# crash is cut off and reported). To stop a long run from here, create the file `STOP` in the
# run folder (or interrupt the kernel): dispatch stops, requests in flight get
# `generate.stop_grace_s` to finish, and the ledger below says what was kept.

# %%
from eagle3data.generate.run import run_generate
from eagle3data.generate.ledger import read_ledger
from eagle3data.core.params import load_params, params_for_display
from eagle3data.audit.report import banners, ledger_banners

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir, "| stop file:", P.run_dir / "STOP")
params_for_display(P)["generate"]

# %% [markdown]
# ## 1. Generate
# For the HTTP backends the line below is live: responses/s and tokens/s over the last
# seconds, money spent, and the credit left on the key (OpenRouter).

# %%
summary = run_generate(P)
print(f"{summary.status}: {summary.new_records} new records in {summary.seconds:.1f} s"
      + (f" — {summary.stop_reason}" if summary.stop_reason else ""))
if summary.torn_tail_bytes:
    print("cut torn journal tails (bytes):", summary.torn_tail_bytes)
banners(ledger_banners(read_ledger(P.run_dir)))  # zero records, prompt lines rejected when read

# %% [markdown]
# ## 2. Ledger: planned, done, errors, skipped (never sent), cancelled (in flight when cut)

# %%
summary.table()

# %% [markdown]
# ## 3. By source and provider: done, errors, tokens, cost

# %%
summary.providers()

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
ledger = read_ledger(P.run_dir)
t = summary.table()
figures = {
    "records": int(t["done"].sum()),
    "new_records": summary.new_records,
    "errors": int(t["errors"].sum()),
    "skipped": int(t["skipped"].sum()),
    "cancelled": int(t["cancelled"].sum()),
    "cost_usd": round(float(t["cost_usd"].sum()), 6),
    "status": ledger["status"],
}
figures
