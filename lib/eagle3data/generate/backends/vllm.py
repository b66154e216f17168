"""vLLM backend: pre-templated prompt ids to the OpenAI-compatible `/v1/completions`, exact ids back.

The prompt is templated here (as for SGLang) and sent as `prompt`: a list of token ids (a
list of such lists when `batch_size > 1`). The completions endpoint takes token-id prompts
as they are: no chat template, no tokenization on the server. The request asks for
`return_token_ids: true` (vLLM >= 0.10.2), so each choice carries `token_ids` (the sampled
ids, the stop token included) and `prompt_token_ids` (what the engine ran on; it must equal
what we sent). `skip_special_tokens: false` and `include_stop_str_in_output: true` keep
special tokens in `text`; the profile's stop ids go as `stop_token_ids`. Text fields come
from the one split of the ids (`spans.output_texts`), as for the other exact backends, so
records are `source: vllm`, `ids_exact: true`.

Before the run, `GET /v1/models` must answer and list the params' model (by served name or
`root` path). Finish reasons: `stop`, `length`, `abort` as they are; `stop_reason` (the stop
token id or string) goes into `native_finish_reason` (`stop:163586`).
"""

from __future__ import annotations

from typing import Any, Sequence

import httpx
import orjson

from eagle3data.core.profiles import Profile
from eagle3data.core.spans import output_texts
from eagle3data.generate.backends.engine import GenerateError, Job, record_dict
from eagle3data.generate.backends.retries import ResponseError
from eagle3data.generate.backends.sglang import _norm, engine_sampling, model_names

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def served_model(listing: dict[str, Any], params: Any, want: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """(name to send as `model`, its /v1/models entry): the configured name `want`, else the one listed."""
    data = listing.get("data") if isinstance(listing, dict) else None
    entries = [e for e in data if isinstance(e, dict) and e.get("id")] if isinstance(data, list) else []
    if want is not None:
        return want, next((e for e in entries if e["id"] == want), None)
    if len(entries) == 1:
        return entries[0]["id"], entries[0]
    ours = model_names(params.model)
    hits = [e for e in entries if {_norm(e.get("id")), _norm(e.get("root"))} & ours]
    return (hits[0]["id"], hits[0]) if len(hits) == 1 else (None, None)


def completion_choices(body: bytes, prompts: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A `/v1/completions` reply as (its object, its `choices`: one object per prompt sent), or ResponseError."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ResponseError(f"body is not JSON ({e}); {len(body)} bytes") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ResponseError("`choices` missing or not a list of objects")
    if len(choices) != prompts:
        raise ResponseError(f"{len(choices)} choices for a batch of {prompts} prompts")
    return obj, choices


class VLLMBackend:
    """Builds `/completions` requests with token-id prompts and turns choices into exact-id records."""

    source = "vllm"
    path = "/completions"
    section = "generate.vllm"  # the params section its errors name

    def __init__(self, params: Any, profile: Profile, tokenizer: Any, settings: Any = None):
        self.params = params
        self.profile = profile
        self.tokenizer = tokenizer
        self.v = settings if settings is not None else params.generate.vllm  # 04's are hidden.vllm
        self.batch_size = self.v.batch_size
        s = params.generate.sampling
        self.base = {"max_tokens": s.max_new_tokens, "seed": s.seed, "return_token_ids": True,
                     "include_stop_str_in_output": True, **engine_sampling(s, profile)}
        self.model_name = self.v.model
        self.sampling = s.model_dump(exclude_none=True)

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json"}

    async def preflight(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """`GET /v1/models` must answer and list the params' model, or the run does not start."""
        base = str(client.base_url)
        try:
            r = await client.get("/models")
        except httpx.HTTPError as e:
            raise GenerateError(f"vLLM server {base} is unreachable: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise GenerateError(f"vLLM server {base}: GET /models answered {r.status_code} "
                                "(base_url must end in /v1)")
        try:
            listing = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            raise GenerateError(f"vLLM server {base}: /models is not JSON") from None
        listed = [e.get("id") for e in (listing.get("data") or []) if isinstance(e, dict)] \
            if isinstance(listing, dict) else []
        name, entry = served_model(listing, self.params, self.v.model)
        m = self.params.model
        if name is None or (self.v.model is not None and entry is None):
            raise GenerateError(f"vLLM server {base} lists models {listed}, none of them "
                                f"{self.v.model or m.name!r}; set {self.section}.model to the served name")
        if self.v.check_model:
            ours = {_norm(m.name), _norm(m.path), _norm(m.tokenizer_path)} - {None}
            theirs = {_norm(entry.get("id")), _norm(entry.get("root"))} - {None}
            if not ours & theirs:
                raise GenerateError(
                    f"vLLM server {base} serves {entry.get('id')!r} (root {entry.get('root')!r}), but params name "
                    f"model {m.name!r} (path {m.path!r}); refusing to start: its ids would not match this "
                    f"tokenizer. Point {self.section}.base_url at the right server, or fix `model` in params.")
        self.model_name = name
        return {"server_model": name, "server_model_root": entry.get("root"),
                "server_max_model_len": entry.get("max_model_len"), "credit_left_usd": None}

    async def credit(self, client: httpx.AsyncClient) -> float | None:
        return None

    def build(self, jobs: Sequence[Job]) -> bytes:
        prompt: Any = jobs[0].prompt_ids if len(jobs) == 1 else [j.prompt_ids for j in jobs]
        return orjson.dumps({"model": self.model_name, "prompt": prompt, **self.base})

    def error_record(self, job: Job, message: str) -> dict[str, Any]:
        return record_dict(job, source=self.source, model=self.params.model.name, profile=self.profile.name,
                           sampling=self.sampling, error=message,
                           usage={"prompt_tokens": len(job.prompt_ids), "completion_tokens": 0,
                                  "reasoning_tokens": None, "cached_tokens": None})

    def _one(self, job: Job, choice: Any, gen_id: Any, latency_s: float) -> dict[str, Any]:
        if not isinstance(choice, dict):
            raise ResponseError(f"choice is {type(choice).__name__}, not an object")
        out = choice.get("token_ids")
        if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
            raise ResponseError("`token_ids` missing or not a list of integers (does the server take "
                                "return_token_ids? vLLM >= 0.10.2)")
        ran_on = choice.get("prompt_token_ids")
        if ran_on is not None and ran_on != job.prompt_ids:
            raise ResponseError(f"`prompt_token_ids` ({len(ran_on)} ids) differ from the {len(job.prompt_ids)} "
                                "prompt ids sent: the server changed the prompt")
        fr = choice.get("finish_reason")
        kind = FINISH.get(fr)
        if kind is None:
            raise ResponseError(f"unknown finish_reason {fr!r}")
        vocab = self.profile.vocab_size
        bad = [t for t in out if t < 0 or t >= vocab]
        if bad:
            raise ResponseError(f"output id {bad[0]} outside the vocabulary (size {vocab})")
        stop_reason = choice.get("stop_reason")
        native = f"{fr}:{stop_reason}" if stop_reason is not None else fr
        text = output_texts(out, self.profile, self.tokenizer)
        return record_dict(
            job, source=self.source, model=self.params.model.name, profile=self.profile.name,
            sampling=self.sampling, output_ids=out, ids_exact=True, reasoning=text.reasoning, content=text.content,
            tool_calls=text.tool_calls, finish_reason=kind, native_finish_reason=native,
            generation_id=gen_id if isinstance(gen_id, str) else None,
            usage={"prompt_tokens": len(job.prompt_ids), "completion_tokens": len(out),
                   "reasoning_tokens": None, "cached_tokens": None},
            latency_s=round(latency_s, 4),
            error="aborted by the server" if kind == "abort" else None,
        )

    def parse(self, jobs: Sequence[Job], body: bytes, latency_s: float) -> list[dict[str, Any]]:
        obj, choices = completion_choices(body, len(jobs))
        # with n=1, choice `index` is the prompt's place in the batch
        by_index = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)
        if [c.get("index", i) for i, c in enumerate(by_index)] != list(range(len(jobs))):
            raise ResponseError(f"choice indices {[c.get('index') for c in choices]} are not 0..{len(jobs) - 1}")
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") \
            if isinstance(usage.get("prompt_tokens_details"), dict) else None
        out = []
        for job, choice in zip(jobs, by_index):
            try:
                rec = self._one(job, choice, obj.get("id"), latency_s)
                if len(jobs) == 1 and usage:  # per-request usage is per-sample only for one prompt
                    rec["usage"].update(prompt_tokens=usage.get("prompt_tokens", rec["usage"]["prompt_tokens"]),
                                        completion_tokens=usage.get("completion_tokens",
                                                                    rec["usage"]["completion_tokens"]),
                                        cached_tokens=cached)
                out.append(rec)
            except ResponseError as e:
                out.append(self.error_record(job, f"malformed response: {e}"))
        return out
