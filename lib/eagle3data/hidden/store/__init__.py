"""04's store on disk, written and read by this package only: shards or per-sample trainer files, the index, the reader.

What 04 writes (`<run>/hidden/` or `hidden.out_dir`, beside the mix of `mix.py`; `extract`
captures the states and hands them to the writers here):
- `shards/rRRR-NNNNN.safetensors`: `hidden_states` [tokens, S, hidden] (bf16 by default; S =
  the states of `hidden.final_state`, `format.state_names`), `input_ids` [tokens] int32, `loss_mask`
  [tokens] uint8, samples concatenated; the shard's metadata lists its samples (offset,
  length) so shards describe themselves. A shard is written to `.tmp` and renamed when
  complete: a crash leaves at most a `.tmp`, which the next run discards and redoes.
- or, with `hidden.layout` a trainer's name (`specforge` / `speculators`), one file per sample
  in that trainer's own format under `samples/` (`p<position>-<key tag><suffix>`, written and read by
  the trainer's module in `eagle3data.trainers`), each with the same `eagle3data` metadata.
  The 05 hand-off hardlinks these files into the trainer's folder instead of copying them.
- `index.parquet` (one row per sample: key, dataset, sample_id, turn, source, ids_exact,
  position in the mix, shard (file), offset, length, loss_tokens) and `index.json` (layers,
  states, sizes, skipped), the one index of the mix's samples in mix order (`index.write_index`).

Each file's content checksum (XXH3-128) is journaled by its writer and kept in the index
(`checksum`: verify-hidden and 05 check it; a store written before checksums is "not checksummed").

One module per concern: `format` (the files' names, states and bytes per token, a file's own
description, the store's errors), `checksum` (a file's content checksum, the writers' journal),
`writer` (shards or a trainer's per-sample files), `index` (the
finished files found on disk, the one index of the mix), `reader` (`HiddenReader`: a sample by key
or row whatever the layout, or the whole store streamed), `validation` (`validate_store`: every
sample re-read against the run's records, through the one reader), `failures` (the samples a worker failed:
`failed_samples.json`, a failed stage or, up to `hidden.allow_failed_samples`, left out of the mix at the merge;
05's refusal of a store 04 did not merge).
"""
