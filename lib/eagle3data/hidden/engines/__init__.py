"""04 through a serving engine (`hidden.backend`): the engine computes the states, the client here stores them.

`vllm_capture` (a vLLM server's `extract_hidden_states`: the request, the files its connector
writes, the checks, the store's one writer), `sglang_capture` (SGLang's two passes), `settings` (what in a
server's settings would cut the states: refused before the first sample), `liveness` (a launched server
watched while it captures: its death stops 04 at once). `vllm_connector/` is the engine side: a folder the
vLLM server puts on its own PYTHONPATH (`cpu_hidden_states`, the CPU build's connector), which
imports no eagle3data and is imported by nothing here (tests/test_layout.py ENGINE_SIDE).
"""
