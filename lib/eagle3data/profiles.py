"""Model profiles: the token ids that structure one assistant turn of a model family.

A profile is the single place that says which id ends a turn, which ids open and close
reasoning, how tool calls are spelled in tokens, which chat-template options to pass, and
which layers EAGLE-3 reads. Every stage reasons on these ids, never on strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ProfileError(ValueError):
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


@dataclass(frozen=True)
class AuxLayers:
    """EAGLE-3 auxiliary layers in both conventions that name the same tensors.

    `hf_indices` index HF `output_hidden_states` (index 0 = embeddings), as vLLM and SGLang
    name them; `layer_outputs` are the decoder layers whose outputs they are (SpecForge hooks):
    `hf_index = layer_output + 1`. The final normed state is stored after the three.
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
