"""OpenAI-compatible chat completions backend, OpenRouter flavour (provider routing, reasoning, cost).

Requests carry the prompt's `messages` (and `tools` where the dataset has them), sampling,
`reasoning` and `provider` settings from params; with turns: all, earlier replies' reasoning goes
back in the field `history_reasoning_field` names (docs/01 "Turns"). Records keep what the API returned as text
(`reasoning`, `content`, `tool_calls`), with `provider`, finish reasons, generation id,
usage (reasoning and cached tokens) and `usage.cost` as `cost_usd`; with
`generate.openai.logprobs`, the choice's `logprobs` as returned (OpenAI shape: `content` /
`refusal` lists of `{token, logprob, bytes, top_logprobs}`; no list for reasoning in either
the OpenAI or the OpenRouter schema). `prompt_ids` is the
locally templated prompt; `output_ids` stays null until 02_reconstruct rebuilds it.
The API key is read from the environment variable named in params and only ever sent in
the Authorization header.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import httpx
import orjson

from eagle3data.core.profiles import Profile
from eagle3data.generate.backends.engine import GenerateError, Job, record_dict
from eagle3data.generate.backends.retries import ResponseError, error_message
from eagle3data.generate.turns import api_messages

FINISH = {"stop": "stop", "tool_calls": "stop", "function_call": "stop", "end_turn": "stop", "length": "length",
          "max_tokens": "length", "content_filter": "abort", "error": "error"}


def history_reasoning_field(o: Any) -> str:
    """The field earlier replies' reasoning goes back in: `generate.openai.history_reasoning`, else from the
    base_url's host (openrouter.ai: `reasoning_details`, OpenRouter's preserved reasoning blocks; any other
    host: `reasoning_content`, Moonshot's API field and the key the Qwen3/Kimi chat templates read)."""
    if o.history_reasoning is not None:
        return o.history_reasoning
    host = (httpx.URL(o.base_url).host or "").lower()
    return "reasoning_details" if host == "openrouter.ai" or host.endswith(".openrouter.ai") else "reasoning_content"


def api_key(env_name: str) -> str:
    """The key from the environment; a clear error names the variable (never a value)."""
    key = os.environ.get(env_name, "").strip()
    if not key:
        raise GenerateError(f"environment variable {env_name} is not set: it must hold the API key "
                            "(keys are never params, never written to any file)")
    return key


class OpenAIBackend:
    """Builds `/chat/completions` requests and turns responses into text records."""

    source = "api"
    path = "/chat/completions"
    batch_size = 1

    def __init__(self, params: Any, profile: Profile):
        self.params = params
        self.profile = profile
        self.o = params.generate.openai
        s = params.generate.sampling
        base: dict[str, Any] = {"model": self.o.model, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                                "top_p": s.top_p, "seed": s.seed}
        if s.top_k is not None:
            base["top_k"] = s.top_k
        if s.min_p is not None:
            base["min_p"] = s.min_p
        if self.o.reasoning is not None:
            base["reasoning"] = self.o.reasoning.model_dump(exclude_none=True)
        prov = self.o.provider.model_dump(exclude_none=True) if self.o.provider is not None else {}
        if self.o.logprobs:  # per-token output for 02 (proof level `token`); only providers that return it
            base["logprobs"] = True
            if self.o.top_logprobs is not None:
                base["top_logprobs"] = self.o.top_logprobs
            prov["require_parameters"] = True
        if prov:
            base["provider"] = prov
        if self.o.check_credit:  # OpenRouter: report cost in usage
            base["usage"] = {"include": True}
        self.base = base
        self.sampling = s.model_dump(exclude_none=True)
        self._key = api_key(self.o.api_key_env)
        self.eot_text = profile.end_of_turn.text
        self.history_reasoning = history_reasoning_field(self.o)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}", "content-type": "application/json"}

    async def credit(self, client: httpx.AsyncClient) -> float | None:
        """`limit_remaining` from GET /key in USD (None: the key has no limit)."""
        r = await client.get("/key")
        if r.status_code in (401, 403):
            raise GenerateError(f"GET /key answered {r.status_code}: the key in {self.o.api_key_env} is refused "
                                f"({error_message(r.content)})")
        if r.status_code != 200:
            raise GenerateError(f"GET /key answered {r.status_code}: {error_message(r.content)} "
                                "(set generate.openai.check_credit: false for servers that are not OpenRouter)")
        try:
            data = orjson.loads(r.content).get("data") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise GenerateError("GET /key did not answer a JSON object") from None
        rem = data.get("limit_remaining")
        return None if rem is None else float(rem)

    async def preflight(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Read the remaining credit; refuse to start below the run's cost cap or `min_credit_usd`."""
        if not self.o.check_credit:
            return {"credit_left_usd": None}
        try:
            rem = await self.credit(client)
        except httpx.HTTPError as e:
            raise GenerateError(f"API {client.base_url} is unreachable: {type(e).__name__}: {e}") from None
        need = max(self.o.min_credit_usd, self.params.generate.cost_cap_usd or 0.0)
        if rem is not None and rem < need:
            raise GenerateError(f"remaining credit ${rem:,.2f} is below the ${need:,.2f} this run needs "
                                "(generate.cost_cap_usd / generate.openai.min_credit_usd); not starting")
        return {"credit_left_usd": rem}

    def build(self, jobs: Sequence[Job]) -> bytes:
        (job,) = jobs
        body = dict(self.base, messages=api_messages(job.messages, self.history_reasoning))
        if job.tools:
            body["tools"] = job.tools
        return orjson.dumps(body)

    def error_record(self, job: Job, message: str) -> dict[str, Any]:
        return record_dict(job, source=self.source, model=self.params.model.name, profile=self.profile.name,
                           sampling=self.sampling, error=message)

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]:
        (job,) = jobs
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise ResponseError(f"body is not JSON ({e}); {len(body)} bytes") from None
        if not isinstance(obj, dict):
            raise ResponseError("body is not a JSON object")
        choices = obj.get("choices")
        if not choices:
            if obj.get("error"):
                return [self.error_record(job, f"API error: {error_message(body)}")]
            raise ResponseError("no `choices`")
        ch = choices[0]
        msg = ch.get("message") if isinstance(ch, dict) else None
        if not isinstance(msg, dict):
            raise ResponseError("`choices[0].message` missing")
        raw_finish = ch.get("finish_reason")
        finish = FINISH.get(raw_finish or "", "error")
        usage_in = obj.get("usage") or {}
        usage = {
            "prompt_tokens": usage_in.get("prompt_tokens"),
            "completion_tokens": usage_in.get("completion_tokens"),
            "reasoning_tokens": (usage_in.get("completion_tokens_details") or {}).get("reasoning_tokens"),
            "cached_tokens": (usage_in.get("prompt_tokens_details") or {}).get("cached_tokens"),
        }
        reasoning = msg.get("reasoning")
        if reasoning is None and isinstance(msg.get("reasoning_details"), list):
            parts = [d.get("text") for d in msg["reasoning_details"] if isinstance(d, dict) and d.get("text")]
            reasoning = "".join(parts) if parts else None
        content = msg.get("content")
        flags = []
        for field, text in (("content", content), ("reasoning", reasoning)):
            if isinstance(text, str) and self.eot_text in text:
                flags.append(f"{field}_has_end_of_turn_text")
        error = None
        if finish == "error":
            err = ch.get("error") or obj.get("error")
            error = (err.get("message") if isinstance(err, dict) else err) or (
                f"finish_reason {raw_finish!r}" if raw_finish else "no finish_reason (truncated generation?)")
        cost = usage_in.get("cost")
        rec = record_dict(
            job, source=self.source, model=self.params.model.name, profile=self.profile.name, sampling=self.sampling,
            reasoning=reasoning, content=content, tool_calls=msg.get("tool_calls") or None, finish_reason=finish,
            native_finish_reason=ch.get("native_finish_reason"), usage=usage,
            cost_usd=float(cost) if isinstance(cost, (int, float)) else None, provider=obj.get("provider"),
            generation_id=obj.get("id"), latency_s=round(latency_s, 4), error=str(error) if error else None,
            api_finish_reason=raw_finish, api_model=obj.get("model"),
        )
        if self.o.logprobs:  # kept as the API returned it (null when the provider sent none)
            rec["logprobs"] = ch.get("logprobs")
        if flags:
            rec["flags"] = flags
        return [rec]
