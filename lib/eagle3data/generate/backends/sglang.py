"""SGLang native `/generate` backend: pre-templated `input_ids` in, untouched `output_ids` out.

The prompt is templated here (it ends with the profile's reasoning-open token where the
template puts one), sent as `input_ids` (a list of them when `batch_size > 1`), with
`skip_special_tokens: false`, `no_stop_trim: true` and the profile's stop ids. Output ids
are kept exactly as the server returned them, so records are `ids_exact`. Before the run,
`GET /health` and `GET /get_model_info` must answer and name the params' model. For many
servers, point `base_url` at `sglang-router`.
"""

from __future__ import annotations

from typing import Any, Sequence

import httpx
import orjson

from eagle3data.core.profiles import Profile
from eagle3data.generate.backends.engine import GenerateError, Job, record_dict
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.core.spans import output_texts


def _norm(name: str | None) -> str | None:
    """Last path component, lower case: `/models/Kimi-K2.5/` and `moonshotai/Kimi-K2.5` agree."""
    if not name:
        return None
    return str(name).rstrip("/").split("/")[-1].lower()


def model_names(model: Any) -> set[str]:
    """The params' model as a server may name it: name, path and tokenizer path, normalised (`_norm`)."""
    return {n for n in (_norm(model.name), _norm(model.path), _norm(model.tokenizer_path)) if n is not None}


def engine_sampling(s: Any, profile: Profile) -> dict[str, Any]:
    """The sampling fields an exact-id engine (SGLang, vLLM) takes as they are: stop on the profile's ids,
    special tokens kept in its text; top_k / min_p only when set. Each backend adds its own names."""
    sp: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p, "skip_special_tokens": False,
                          "stop_token_ids": list(profile.stop_ids)}
    if s.top_k is not None:
        sp["top_k"] = s.top_k
    if s.min_p is not None:
        sp["min_p"] = s.min_p
    return sp


def model_matches(info: dict[str, Any], model: Any) -> bool:
    """True when the server's model or tokenizer path names the params' model (name, path or tokenizer)."""
    ours = model_names(model)
    theirs = {_norm(info.get("model_path")), _norm(info.get("tokenizer_path")), _norm(info.get("served_model_name"))}
    return bool(ours & (theirs - {None}))


class SGLangBackend:
    """Builds `/generate` requests and turns responses into exact-id records."""

    source = "sglang"
    path = "/generate"
    section = "generate.sglang"  # the params section its errors name

    def __init__(self, params: Any, profile: Profile, tokenizer: Any, settings: Any = None):
        self.params = params
        self.profile = profile
        self.tokenizer = tokenizer
        self.s = settings if settings is not None else params.generate.sglang  # 04's are hidden.sglang
        self.batch_size = self.s.batch_size
        s = params.generate.sampling
        self.sampling_params = {"max_new_tokens": s.max_new_tokens, "no_stop_trim": True, **engine_sampling(s, profile)}
        self.sampling = s.model_dump(exclude_none=True)

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json"}

    async def preflight(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """`/health` must answer 200 and `/get_model_info` must name our model, or the run does not start."""
        base = str(client.base_url)
        try:
            h = await client.get("/health")
            if h.status_code != 200:
                raise GenerateError(f"SGLang server {base} is not healthy: GET /health answered {h.status_code}")
            r = await client.get("/get_model_info")
        except httpx.HTTPError as e:
            raise GenerateError(f"SGLang server {base} is unreachable: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise GenerateError(f"SGLang server {base}: GET /get_model_info answered {r.status_code}")
        try:
            info = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            raise GenerateError(f"SGLang server {base}: /get_model_info is not JSON") from None
        if info.get("is_generation") is False:
            raise GenerateError(f"SGLang server {base} serves a non-generation model {info.get('model_path')!r}")
        m = self.params.model
        if self.s.check_model and not model_matches(info, m):
            raise GenerateError(
                f"SGLang server {base} serves model_path={info.get('model_path')!r} "
                f"tokenizer_path={info.get('tokenizer_path')!r}, but params name model {m.name!r} "
                f"(path {m.path!r}); refusing to start: its ids would not match this tokenizer. "
                f"Point {self.section}.base_url at the right server, or fix `model` in params.")
        return {"server_model_path": info.get("model_path"), "server_tokenizer_path": info.get("tokenizer_path"),
                "credit_left_usd": None}

    async def credit(self, client: httpx.AsyncClient) -> float | None:
        return None

    def build(self, jobs: Sequence[Job]) -> bytes:
        ids: Any = jobs[0].prompt_ids if len(jobs) == 1 else [j.prompt_ids for j in jobs]
        return orjson.dumps({"input_ids": ids, "sampling_params": self.sampling_params})

    def error_record(self, job: Job, message: str) -> dict[str, Any]:
        return record_dict(job, source=self.source, model=self.params.model.name, profile=self.profile.name,
                           sampling=self.sampling, error=message,
                           usage={"prompt_tokens": len(job.prompt_ids), "completion_tokens": 0,
                                  "reasoning_tokens": None, "cached_tokens": None})

    def _one(self, job: Job, item: Any, latency_s: float) -> dict[str, Any]:
        if not isinstance(item, dict):
            raise ResponseError(f"response item is {type(item).__name__}, not an object")
        out = item.get("output_ids")
        meta = item.get("meta_info")
        if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
            raise ResponseError("`output_ids` missing or not a list of integers")
        if not isinstance(meta, dict):
            raise ResponseError("`meta_info` missing")
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in ("stop", "length", "abort"):
            raise ResponseError(f"unknown meta_info.finish_reason {fr!r}")
        native = kind
        if isinstance(fr, dict):
            detail = fr.get("matched", fr.get("length", fr.get("message")))
            native = f"{kind}:{detail}" if detail is not None else kind
        vocab = self.profile.vocab_size
        bad = [t for t in out if t < 0 or t >= vocab]
        if bad:
            raise ResponseError(f"output id {bad[0]} outside the vocabulary (size {vocab})")
        text = output_texts(out, self.profile, self.tokenizer)
        return record_dict(
            job, source=self.source, model=self.params.model.name, profile=self.profile.name,
            sampling=self.sampling, output_ids=out, ids_exact=True, reasoning=text.reasoning, content=text.content,
            tool_calls=text.tool_calls,
            finish_reason=kind, native_finish_reason=native, generation_id=meta.get("id"),
            usage={"prompt_tokens": meta.get("prompt_tokens", len(job.prompt_ids)),
                   "completion_tokens": meta.get("completion_tokens", len(out)),
                   "reasoning_tokens": None, "cached_tokens": meta.get("cached_tokens")},
            latency_s=round(float(meta.get("e2e_latency") or latency_s), 4),
            error=fr.get("message") if isinstance(fr, dict) and kind == "abort" else None,
        )

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise ResponseError(f"body is not JSON ({e}); {len(body)} bytes") from None
        items = obj if isinstance(obj, list) else [obj]
        if len(items) != len(jobs):
            raise ResponseError(f"{len(items)} results for a batch of {len(jobs)} prompts")
        out = []
        for job, item in zip(jobs, items):
            try:
                out.append(self._one(job, item, latency_s))
            except ResponseError as e:
                out.append(self.error_record(job, f"malformed response: {e}"))
        return out
