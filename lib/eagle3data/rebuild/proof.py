"""02's proof vocabulary: the flags a rebuilt record can carry, the proof levels and the one grading rule.

`FLAGS` names every flag the rebuild sets (informational ones describe the record; the
others are problems for 03_audit to judge), `PROOF_LEVELS` orders the levels weakest first
(`PROOF_RANK` their rank, `PROOF_MEANING` what each proves), and `Rebuilt` is one rebuilt
assistant turn with its verification facts, whose `grade` sets the count flags against the
calibrated offsets, names the checks for what they prove and decides the level (`grade_facts`: the same rule
on the facts alone, for 02's lines graded after they were written). The rebuild
that fills a `Rebuilt` is `text.rebuild_batch`; the stage that calibrates the offsets is `run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Flags a rebuilt record can carry. Informational ones describe the record; the others are
# problems for 03_audit to judge (the rebuild never repairs the text).
FLAGS: dict[str, str] = {
    "truncated": "finish_reason is length/abort: no end-of-turn appended",
    "truncated_in_reasoning": "cut inside reasoning: no reasoning-close appended either",
    "length_cut_after_reasoning": "length cut with empty content, but the billed reasoning tokens (or the provider's "
                                  "tokens) show the model closed its reasoning: the reasoning-close is kept",
    "empty_reasoning": "reasoning profile but the reasoning text is empty",
    "empty_output": "no reasoning, content or tool calls at all",
    "prompt_closed_reasoning": "the prompt's template already closed reasoning (thinking off): no reasoning block added",
    "reasoning_after_closed_prompt": "the prompt closed reasoning, yet the API returned reasoning text (kept as plain "
                                     "text before the content: the ids cannot be the model's)",
    "content_has_end_of_turn": "content holds the end-of-turn (or guard) token",
    "content_has_reasoning_token": "content holds a reasoning-open/close token",
    "content_has_tool_call_token": "content holds raw tool-call tokens (kept as they are)",
    "reasoning_has_tool_call_token": "reasoning holds a tool-call token",
    "reasoning_has_reasoning_token": "reasoning holds a reasoning-open/close token",
    "reasoning_has_end_of_turn": "reasoning holds the end-of-turn (or guard) token",
    "content_has_added_token_text": "content holds the literal text of another added/special token of the tokenizer "
                                    "(e.g. <|im_start|>, <|endoftext|>, <tool_response>, fill-in-middle): it "
                                    "encodes as that token's id, which the model may not have emitted",
    "reasoning_has_added_token_text": "reasoning holds the literal text of another added/special token of the tokenizer",
    "content_has_replacement_char": "content holds U+FFFD: the engine emitted bytes that are not valid UTF-8 there; "
                                    "the text lost them, so no rebuild from text can be the model's ids",
    "reasoning_has_replacement_char": "reasoning holds U+FFFD (see content_has_replacement_char)",
    "tool_calls_without_native_form": "structured tool calls, but the profile has no tool-call tokens: not rendered",
    "bad_tool_call": "a tool call without a function name or with unusable arguments",
    "structure_token_split": "a structural token (think, tool-call, end-of-turn) did not encode as its own single id "
                             "on its span: the tokenizer has an added token overlapping it (a profile/tokenizer "
                             "mismatch; cannot happen on the shipped Qwen3/SmolLM2/Kimi vocabularies)",
    "roundtrip_mismatch": "decode(ids) differs from the assembled text (e.g. NFC normalization): the ids do not spell it",
    "no_billed_count": "the API billed no completion_tokens to compare with",
    "count_outside_tolerance": "rebuilt length differs from billed tokens (+ the calibrated offset) by more than "
                               "reconstruct.count_tolerance of them",
    "count_off_offset": "rebuilt length minus billed completion tokens is not the calibrated offset of its "
                        "(provider, dataset, end): a token more or less than the model produced",
    "reasoning_count_off_offset": "rebuilt reasoning span minus billed reasoning tokens is not the calibrated offset",
    "provider_tokens_unusable": "the API returned per-token output that does not map to the tokenizer's ids or does "
                                "not spell the text: rebuilt from text instead",
    "prompt_templated_here": "the record had no prompt_ids: templated from its messages",
}

# Proof levels, weakest first. `engine` records come from the journal (02 never writes them).
PROOF_LEVELS: tuple[str, ...] = ("failed", "text", "count", "token", "engine")
PROOF_RANK: dict[str, int] = {lv: i for i, lv in enumerate(PROOF_LEVELS)}
PROOF_MEANING: dict[str, str] = {
    "engine": "the ids an engine produced (local, SGLang, vLLM with token ids): nothing rebuilt",
    "token": "every text span's ids are the provider's own tokens (logprobs), mapped to ids and proven to spell the "
             "text; only structural tokens (think, end-of-turn) are placed by the profile; billed counts agree",
    "count": "rebuilt by re-tokenizing: the ids spell the text, the billed completion count equals the rebuilt length "
             "after the (provider, dataset) offset, the billed reasoning count agrees where reported, and nothing "
             "risky is in the text. A same-count resplit (H+AVING vs HAV+ING) is still possible: drift by level "
             "measures how often",
    "text": "only that the ids spell the API text: the count is off its offset or not billed, or the text holds "
            "something its ids cannot be sure of (U+FFFD, the literal text of a special token, reasoning after a "
            "closed prompt)",
    "failed": "the ids do not spell the returned text, or the response cannot be rendered (empty, bad or "
              "unrenderable tool calls)",
}
_FAILED_FLAGS = frozenset({"roundtrip_mismatch", "empty_output", "bad_tool_call", "tool_calls_without_native_form"})
_RISKY_FLAGS = frozenset({
    "content_has_end_of_turn", "content_has_reasoning_token", "content_has_tool_call_token",
    "reasoning_has_tool_call_token", "reasoning_has_reasoning_token", "reasoning_has_end_of_turn",
    "content_has_added_token_text", "reasoning_has_added_token_text", "content_has_replacement_char",
    "reasoning_has_replacement_char", "structure_token_split", "reasoning_after_closed_prompt",
})
_CALIBRATED_FLAGS = ("count_outside_tolerance", "count_off_offset", "reasoning_count_off_offset")


@dataclass
class Rebuilt:
    """One rebuilt assistant turn, its verification and its proof level (`grade`)."""

    output_ids: list[int]
    text: str
    flags: list[str]
    seam_ok: bool
    seam_first_diff: int | None
    roundtrip_ok: bool
    billed_tokens: int | None
    count_diff: int | None
    billed_reasoning: int | None = None
    reasoning_rebuilt: int | None = None  # ids of the reasoning span (without open/close)
    reasoning_diff: int | None = None
    token_exact_spans: list[str] = field(default_factory=list)  # spans whose ids are the provider's tokens
    needed_spans: list[str] = field(default_factory=list)  # text spans of the turn ("tools": never token-exact)
    proof_level: str = "text"
    checks: dict[str, Any] = field(default_factory=dict)
    count_offset: int = 0
    reasoning_offset: int | None = 0
    count_tolerance: float = 0.02

    def grade(self, count_offset: int = 0, reasoning_offset: int | None = 0) -> "Rebuilt":
        """Set the count flags against the offsets, the checks (named for what they prove) and the proof level."""
        self.flags, self.proof_level, self.checks = grade_facts(
            self.flags, self.count_diff, self.billed_tokens, self.reasoning_diff, self.token_exact_spans,
            self.needed_spans, self.roundtrip_ok, self.seam_ok, count_offset, reasoning_offset, self.count_tolerance)
        self.count_offset, self.reasoning_offset = count_offset, reasoning_offset
        return self


def grade_facts(flags: list[str], count_diff: int | None, billed_tokens: int | None, reasoning_diff: int | None,
                token_exact_spans: list[str], needed_spans: list[str], roundtrip_ok: bool, seam_ok: bool,
                count_offset: int, reasoning_offset: int | None, count_tolerance: float
                ) -> tuple[list[str], str, dict[str, Any]]:
    """The one grading rule, on a rebuilt turn's facts: (flags with the count flags set against the offsets,
    proof level, checks). `Rebuilt.grade` applies it to a rebuild; 02's stream to a line it wrote before its
    dataset's offsets were known (the facts are the line's, plus its text spans)."""
    fl = [f for f in flags if f not in _CALIBRATED_FLAGS]
    count_ok = None if count_diff is None else count_diff == count_offset
    if count_ok is False:
        if abs(count_diff - count_offset) > count_tolerance * max(billed_tokens or 0, 1):  # type: ignore[operator]
            fl.append("count_outside_tolerance")
        fl.append("count_off_offset")
    r_ok = None if reasoning_diff is None or reasoning_offset is None else reasoning_diff == reasoning_offset
    if r_ok is False:
        fl.append("reasoning_count_off_offset")
    exact = set(token_exact_spans)
    risky = bool(fl) and any(f in _RISKY_FLAGS and f.partition("_has_")[0] not in exact for f in fl)
    if fl and any(f in _FAILED_FLAGS for f in fl):
        level = "failed"
    elif needed_spans and exact.issuperset(needed_spans) and not risky and count_ok is not False \
            and r_ok is not False:
        level = "token"
    elif count_ok and r_ok is not False and not risky:
        level = "count"
    else:
        level = "text"
    checks = {"ids_spell_text": roundtrip_ok, "structure_tokens_whole": seam_ok, "count_on_offset": count_ok,
              "reasoning_count_on_offset": r_ok, "spans_from_provider": sorted(exact)}
    return fl, level, checks
