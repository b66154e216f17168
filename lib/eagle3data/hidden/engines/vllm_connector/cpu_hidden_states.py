"""vLLM's hidden-states connector for its CPU build: loaded by the SERVER (engine venv), never by eagle3data.

`vllm ... --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path":
"cpu_hidden_states", ...}'` with this folder on the server's PYTHONPATH (`hidden/engines/vllm_capture.py`
builds the command). vLLM 0.32's `ExampleHiddenStatesConnector` copies each finished request's
states out of the hidden-states cache on a CUDA stream into pinned memory, and reports the request
done when a CUDA event says so; on CPU `pin_memory=True` kills the engine and there are no events.
This subclass overrides only that asynchronous write: the slots are copied out of the cache at once
(the copy is what the cache's blocks may be freed after), the file is written by the connector's
own thread pool under its own exclusive lock (released when written, as the stock one), and the
"copy done" event is one that is always done. The file, lock, path and metadata are the stock ones.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)


class CopiedEvent:
    """The stand-in of a CUDA event for a copy that is already complete (`query`, `synchronize`)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose write copies on the CPU (no CUDA stream, no pinned memory)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None, :]
                 + blocks[:, None] * self._block_size).flatten()
        # advanced indexing gathers the slots into a new tensor: the copy the cache's blocks may be freed after
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another KV transfer request with the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CopiedEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
