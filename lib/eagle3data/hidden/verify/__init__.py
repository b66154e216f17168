"""`eagle3data verify-hidden`: prove that the stored states are the target's own (docs/04 "Verify").

`run` (`verify_store`: one streamed pass over the store, the verdicts, `verify.jsonl` and its
summary, the store's fingerprint), `checks` (the per-sample figures without the head, the limits
and verdicts), `prefix` (samples sharing a prefix of ids have the same states over it), `head`
(the target's head read from the checkpoint: the logit z, top-1, log-prob),
`vllm` (the recompute backend for a store a vLLM server made) and `command` (the CLI entry, the
run's params and the recompute backends).
"""
