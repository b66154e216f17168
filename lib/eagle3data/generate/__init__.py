"""Stage 01: run prompt datasets through the target and journal the exact token ids.

Owns the plan (`plan`: what to send, resume by key, the turn plan, budgets), the local batch
loop (`local`), the run with its asyncio/GC glue (`run.run_generate`) and its stop signals
(`signals`), the ledger (`ledger`), conversations regenerated turn by turn (`turns`) and the
HTTP engine with its backends (`backends`: engine and retries, SGLang `/generate`, vLLM,
OpenAI-style APIs, the HTTP/2 transport).
May import the core and `prompts`; never a later stage.
"""
