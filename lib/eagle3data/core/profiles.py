"""Model profiles: the token ids that structure one assistant turn of a model family.

A profile is the single place that says which id ends a turn, which ids open and close
reasoning, how tool calls are spelled in tokens, which chat-template options to pass, and
which layers EAGLE-3 reads. Every stage reasons on these ids, never on strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from eagle3data.core.errors import UserInputError


class ProfileError(UserInputError, ValueError):
    """A profile does not fit the tokenizer it is used with."""


@dataclass(frozen=True)
class Token:
    """One special or added token: its text and its id in the model's vocabulary."""

    text: str
    id: int


@dataclass(frozen=True)
class ToolCallTokens:
    """How a model spells tool calls in tokens.

    `section_begin`/`section_end` wrap all calls of a turn (Kimi); `call_begin`/`call_end`
    wrap one call; `argument_begin` separates the call's name from its JSON arguments (Kimi).
    `style` names the rendering used by 02_reconstruct: "kimi" or "qwen3".
    """

    style: str
    call_begin: Token
    call_end: Token
    section_begin: Token | None = None
    section_end: Token | None = None
    argument_begin: Token | None = None

    def tokens(self) -> list[Token]:
        return [
            t
            for t in (self.section_begin, self.call_begin, self.argument_begin, self.call_end, self.section_end)
            if t is not None
        ]


@dataclass(frozen=True)
class OutputSplit:
    """The spans of one output, cut on the profile's ids: the one split every stage uses.

    `reasoning`: the reasoning ids (without reasoning-open/close; None for a non-reasoning
    profile). `content`: the answer ids an API returns as `content` (without the tool-call
    section, stop ids, guard). `calls`: the id runs of each tool call's body (Kimi: the
    `functions.NAME:IDX` part, the argument token, the JSON), or None when the output has no
    well-formed native calls; a malformed tool section stays in `content`, raw. `stop`: the
    stop ids at the end (end-of-turn, guard; empty when truncated). `reasoning_closed`: a
    reasoning-close was found. A stop id inside the body stays in it (03's
    `output.single_eot` fails such a record; the text keeps what the ids say).
    """

    reasoning: list[int] | None
    content: list[int]
    calls: list[list[int]] | None
    stop: list[int]
    reasoning_closed: bool


@dataclass(frozen=True)
class Profile:
    """What structures an assistant turn for one model family.

    Attributes:
        name: profile key used in params (`smollm2`, `qwen3`, `kimi-k2.5`).
        end_of_turn: the token that ends an assistant turn (a stop id for generation).
        guard: optional token the model may emit right after end-of-turn (Kimi `[EOS]`).
        reasoning_open / reasoning_close: `<think>` / `</think>` for reasoning models.
        tool_calls: tool-call token spelling, or None when the model has none.
        vocab_size: ids must be below this (the embedding rows of the model).
        template_kwargs: extra keyword arguments to `apply_chat_template` (thinking on).
        prompt_ends_with_reasoning_open: the generation prompt already ends with
            `<think>`, so the output starts inside reasoning (Kimi).
        template_supports_tools: the chat template renders `tools=`; if False, tool
            definitions go into the system prompt the way glaive-style datasets do.
        num_layers: decoder layers of the reference model (for the layer rule).
        hidden_size: hidden width of the reference model (for size estimates).
    """

    name: str
    end_of_turn: Token
    vocab_size: int
    num_layers: int
    hidden_size: int
    guard: Token | None = None
    reasoning_open: Token | None = None
    reasoning_close: Token | None = None
    tool_calls: ToolCallTokens | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_ends_with_reasoning_open: bool = False
    template_supports_tools: bool = False

    @property
    def is_reasoning(self) -> bool:
        return self.reasoning_close is not None

    @property
    def stop_ids(self) -> list[int]:
        """Ids generation stops on: end-of-turn, and the guard where the profile has one."""
        return [self.end_of_turn.id] + ([self.guard.id] if self.guard else [])

    def special_tokens(self) -> list[Token]:
        """Every token this profile names, for checks and for marking in the inspector."""
        out = [self.end_of_turn]
        for t in (self.guard, self.reasoning_open, self.reasoning_close):
            if t is not None:
                out.append(t)
        if self.tool_calls is not None:
            out.extend(self.tool_calls.tokens())
        return out

    def split_output(self, output_ids: Sequence[int]) -> OutputSplit:
        """Cut output ids into reasoning, answer and tool calls (see `OutputSplit`).

        Trailing stop ids (end-of-turn, guard) are cut off the end; reasoning starts after a leading reasoning-open (Qwen3 may emit one) and ends at the
        first reasoning-close, or runs to the end when there is none (cut inside reasoning);
        the tool section starts at the first section-begin (Kimi) or call-begin (Qwen3).
        """
        body = [int(t) for t in output_ids]
        stops, k = set(self.stop_ids), len(body)
        while k and body[k - 1] in stops:
            k -= 1
        body, stop = body[:k], body[k:]
        reasoning: list[int] | None = None
        closed = False
        if self.is_reasoning:
            ro, rc = self.reasoning_open, self.reasoning_close
            if ro is not None and body[:1] == [ro.id]:
                body = body[1:]
            if rc is not None and rc.id in body:
                k = body.index(rc.id)
                reasoning, body, closed = body[:k], body[k + 1:], True
            else:
                reasoning, body = body, []
        calls: list[list[int]] | None = None
        tc = self.tool_calls
        if tc is not None:
            first = (tc.section_begin or tc.call_begin).id
            if first in body:
                k = body.index(first)
                calls = _cut_calls(body[k:], tc)
                if calls is not None:
                    body = body[:k]
        return OutputSplit(reasoning, body, calls, stop, closed)

    def aux_layers(self, num_layers: int | None = None) -> "AuxLayers":
        """The EAGLE-3 layers for a model with `num_layers` decoder layers (default: the profile's)."""
        return aux_layers(num_layers if num_layers is not None else self.num_layers)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ProfileError unless every id of this profile decodes to its token text.

        Guards against the silent failure where a profile written for one vocabulary is used
        with another: every later check would count the wrong token.
        """
        problems = []
        for tok in self.special_tokens():
            got = tokenizer.convert_ids_to_tokens(tok.id) if tok.id < len(tokenizer) else None
            if got != tok.text:
                problems.append(f"id {tok.id} should be {tok.text!r} but the tokenizer has {got!r}")
        if problems:
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise ProfileError(
                f"profile {self.name!r} does not match tokenizer {name!r}: " + "; ".join(problems)
            )


def _cut_calls(body: list[int], tc: ToolCallTokens) -> list[list[int]] | None:
    """Id runs of each call body in a tool section, or None if it is malformed.

    Qwen3 (no section tokens): text between or after calls is dropped, as server tool parsers do.
    """
    b, e = tc.call_begin.id, tc.call_end.id
    if tc.section_begin is not None:
        if body[:1] != [tc.section_begin.id] or body[-1:] != [tc.section_end.id]:  # type: ignore[union-attr]
            return None
        body = body[1:-1]
    calls, i = [], 0
    while i < len(body):
        if body[i] != b:
            if tc.section_begin is None and body[i] != e:
                i += 1
                continue
            return None
        try:
            k = body.index(e, i + 1)
        except ValueError:
            return None
        if b in body[i + 1:k]:
            return None
        calls.append(body[i + 1:k])
        i = k + 1
    return calls or None


@dataclass(frozen=True)
class AuxLayers:
    """EAGLE-3 auxiliary layers in both conventions that name the same tensors.

    `hf_indices` index HF `output_hidden_states` (index 0 = embeddings), as vLLM names them and as
    SGLang's defaults are; `layer_outputs` are the decoder layers whose outputs they are (SpecForge
    hooks; SGLang's explicit layer ids for most models): `hf_index = layer_output + 1`. The final normed state is stored after the three.
    """

    num_layers: int
    hf_indices: tuple[int, int, int]
    layer_outputs: tuple[int, int, int]


def aux_layers(num_layers: int) -> AuxLayers:
    """EAGLE-3 rule: HF indices [2, N//2, N-3] = outputs of layers [1, N//2-1, N-4]."""
    if num_layers < 5:
        raise ValueError(f"EAGLE-3 needs at least 5 decoder layers, got {num_layers}")
    idx = (2, num_layers // 2, num_layers - 3)
    return AuxLayers(num_layers, idx, tuple(i - 1 for i in idx))  # type: ignore[arg-type]


SMOLLM2 = Profile(
    name="smollm2",
    end_of_turn=Token("<|im_end|>", 2),
    vocab_size=49152,
    num_layers=30,
    hidden_size=576,
)

QWEN3 = Profile(
    name="qwen3",
    end_of_turn=Token("<|im_end|>", 151645),
    vocab_size=151936,
    num_layers=36,  # Qwen3-8B; the rule takes the loaded model's count when there is one
    hidden_size=4096,
    reasoning_open=Token("<think>", 151667),
    reasoning_close=Token("</think>", 151668),
    tool_calls=ToolCallTokens(
        style="qwen3", call_begin=Token("<tool_call>", 151657), call_end=Token("</tool_call>", 151658)
    ),
    template_kwargs={"enable_thinking": True},
    prompt_ends_with_reasoning_open=False,
    template_supports_tools=True,
)

KIMI_K25 = Profile(
    name="kimi-k2.5",
    end_of_turn=Token("<|im_end|>", 163586),
    guard=Token("[EOS]", 163585),
    vocab_size=163840,
    num_layers=61,
    hidden_size=7168,
    reasoning_open=Token("<think>", 163606),
    reasoning_close=Token("</think>", 163607),
    tool_calls=ToolCallTokens(
        style="kimi",
        section_begin=Token("<|tool_calls_section_begin|>", 163595),
        section_end=Token("<|tool_calls_section_end|>", 163596),
        call_begin=Token("<|tool_call_begin|>", 163597),
        argument_begin=Token("<|tool_call_argument_begin|>", 163598),
        call_end=Token("<|tool_call_end|>", 163599),
    ),
    template_kwargs={"thinking": True},
    prompt_ends_with_reasoning_open=True,
    template_supports_tools=True,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (SMOLLM2, QWEN3, KIMI_K25)}


def get_profile(name: str) -> Profile:
    """Look up a shipped profile by name; a clear error lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}") from None
