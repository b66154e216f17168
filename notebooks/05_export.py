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
# # 05 · Export for drafter trainers
# Hands exactly 04's training mix (same keys, same order) to SpecForge and vllm speculators in
# their own layouts, plus the EAGLE-3 draft vocabulary (`d2t` / `t2d`), and shows how much of
# the generated output that vocabulary covers.
#
# **Reads:** `outputs/<run>/hidden/mix.parquet` and `hidden/` (04's mix and stored states; the
# mix rule is applied here when 04 has not run), the records of the mix's samples.
# **Writes:** `outputs/<run>/export/specforge/` (`features/*.ckpt`, `vocab_mapping.pt`,
# `specforge.yaml`, plus `conversations.jsonl`, `token_ids.jsonl`), `export/speculators/` (the
# `datasets` folder, `hidden_states/hs_<i>.safetensors`, `d2t-<N>.npy` / `t2d-<N>.npy`, plus
# `data.parquet`), `export/draft_vocab.safetensors`, a `manifest.json` per format,
# `export/peers.log` (datasets' and speculators' own log lines), `provenance/05_export.json`.
# **Parameters:** `params_file` (a YAML under `params/`), `overrides` (dotted keys, as
# `-p key value` on the CLI); the stage's own keys live under `export:` (`draft_vocab_size`,
# `formats`: also `speculators_online` / `specforge_online`, ids and masks for trainers that compute the states as they
# train, no 04 store needed). Every manifest counts for how many rows a text-only trainer's tokenization reproduces
# our ids. See `docs/05_export.md` for the command each trainer runs.

# %%
from eagle3data.export.run import run_export
from eagle3data.export.text_drift import drift_line
from eagle3data.core.params import load_params, params_for_display
from eagle3data.audit.report import export_banners

# %% tags=["parameters"]
params_file = "params/embedded.yaml"
overrides = {}

# %%
P = load_params(params_file, overrides)
print("run folder:", P.run_dir)
params_for_display(P)["export"]

# %% [markdown]
# ## 1. Export both formats and the draft vocabulary

# %%
result = run_export(P)
print("written to", result.out_dir)
print(drift_line(result.manifests[next(iter(result.manifests))]["text_trainers"]))  # the text trainers' rule
export_banners(result)  # an unaudited export, failed records let in, or nothing exported

# %% [markdown]
# ## 2. What went out, per dataset (exact vs rebuilt ids), and what was skipped and why
# Skip reasons: `error` / `abort` (no complete response), `no_ids` (API record that stage 02
# has not rebuilt), `no_verdict` (the audit has no verdict for it), `failed_audit`.

# %%
result.table()

# %% [markdown]
# ## 3. Files for each trainer

# %%
result.files_table()

# %% [markdown]
# ## 4. Draft vocabulary coverage
# Share of generated output tokens (loss mask 1) whose id is in the draft vocabulary. When the
# outputs hold fewer distinct ids than the size, the rest is filled with the smallest unused ids.

# %%
result.vocab.summary()

# %%
result.coverage_figure()

# %% [markdown] tags=["hide-from-html"]
# ## Figures recorded for tests
# (left out of the notebook's HTML copy: the cell tag `hide-from-html`)

# %% tags=["hide-from-html"]
first = result.manifests[next(iter(result.manifests))]  # every format exports the same mix; the first's counts
figures = {
    "exported": first["exported"],
    "ids_exact": first["ids_exact"],
    "ids_rebuilt": first["ids_rebuilt"],
    "skipped": first["skipped"],
    "output_tokens": result.vocab.output_tokens,
    "draft_vocab_size": len(result.vocab.d2t),
    "draft_vocab_coverage": round(result.vocab.coverage, 6),
    "draft_vocab_filled": result.vocab.filled,
    "text_trainers_reproduced": first["text_trainers"].get("reproduced"),  # of the rows: chat template as text, encoded
    "text_trainers_rows": first["text_trainers"].get("rows"),
}
figures
