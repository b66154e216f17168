"""04 through a serving engine (`hidden.backend`): the engine computes the states, the client here stores them.

`vllm_capture` (a vLLM server's `extract_hidden_states`: the request, the files its connector
writes, the checks, the store's one writer). `vllm_connector/` is the engine side: a folder the
vLLM server puts on its own PYTHONPATH (`cpu_hidden_states`, the CPU build's connector), which
imports no eagle3data and is imported by nothing here (tests/test_layout.py ENGINE_SIDE).
"""
