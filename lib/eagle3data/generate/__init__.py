"""Stage 01: run prompt datasets through the target and journal the exact token ids.

Owns the run (`run.run_generate`: the plan, the local batch loop, resume by key, budgets),
its ledger (`ledger`), conversations regenerated turn by turn (`turns`) and the HTTP engine
with its backends (`backends`: SGLang `/generate`, vLLM, OpenAI-style APIs, HTTP/2 transport).
May import the core and `prompts`; never a later stage.
"""
