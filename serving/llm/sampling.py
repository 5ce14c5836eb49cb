"""Per-request sampling for the LLM engine: validated `SamplingParams`, stop-string detection over
streamed text (`StopMatcher`) and incremental detokenisation (`Detokenizer`).

The draw itself is the `sample_tokens` operator (cuda/ops/sample.cuh; gpuos_core/sampler.py in
torch): Philox keyed by the request's seed with its token's index as counter, so a request's tokens
depend only on its own seed and distributions, never on which other requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuos_core.errors import GpuosError

MAX_STOPS = 4  # OpenAI's limit on stop strings per request
INCOMPLETE = "\ufffd"  # what decode shows for a UTF-8 sequence that later tokens complete


class SamplingError(GpuosError, ValueError):
    """Sampling parameters out of range, or a batch whose logits, params and generators disagree."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param  # the offending parameter's name (an API error reports it)
        super().__init__(message)


def _require(ok: bool, field: str, allowed: str, value: Any) -> None:
    if not ok:
        raise SamplingError(f"{field} must be {allowed}, got {value!r}", field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_stops(value: Any) -> tuple[str, ...]:
    """`stop` as a tuple; like OpenAI's API, one string or None is accepted too."""
    if value is None or isinstance(value, str):
        return () if value is None else (value,)
    _require(isinstance(value, (list, tuple)), "stop", "a string or a list of strings", value)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it ends; every field is checked at
    construction."""

    max_tokens: int = 16  # tokens to generate at most; >= 1
    temperature: float = 1.0  # in [0, 2]; 0 is greedy (argmax)
    top_p: float = 1.0  # in (0, 1]; nucleus mass kept, 1 = off
    top_k: int = 0  # >= 0; highest-probability tokens kept, 0 = off
    seed: int | None = None  # makes this request's draws reproducible; None: fresh ones
    stop: tuple[str, ...] = ()  # up to MAX_STOPS non-empty strings that end the completion

    def __post_init__(self) -> None:
        """Raises SamplingError naming the first bad field and its allowed range."""
        # frozen: a list becomes a hashable tuple
        object.__setattr__(self, "stop", _as_stops(self.stop))
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _require(
            _is_real(self.temperature) and 0 <= self.temperature <= 2,
            "temperature",
            "a number in [0, 2]",
            self.temperature,
        )
        _require(
            _is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p
        )
        _require(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            "an integer >= 0 (0 = off)",
            self.top_k,
        )
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
            "seed",
            "None or an integer in [0, 2**64)",
            self.seed,
        )
        _require(
            len(self.stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"at most {MAX_STOPS} non-empty strings",
            list(self.stop),
        )


class StopMatcher:
    """Incremental stop-string detection over streamed text, for one request.

    feed(delta) returns the text safe to emit now and whether a stop string was found. When found,
    the text ends just before the earliest stop string (it and anything after are never emitted)
    and no further feeds may be made. Text ending in a proper prefix of a stop string is held back
    until a later delta completes or rules out the stop. flush() returns the held text, for a
    request that ends for another reason (max_tokens, eos).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held = tuple(stops), ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:  # most requests: nothing to look for, nothing held
            return delta, False
        # the held text holds every possible start of a stop that spans deltas, so searching it plus
        # the delta finds every stop occurrence
        text = self.held + delta
        if starts := [i for stop in self.stops if (i := text.find(stop)) >= 0]:
            self.held = ""
            return text[: min(starts)], True
        cut = len(text) - self._partial(text)
        self.held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        return max(
            (
                n
                for stop in self.stops
                for n in range(1, min(len(stop), len(text) + 1))
                if text.endswith(stop[:n])
            ),
            default=0,
        )


class Detokenizer:
    """Incremental decoding of one request's generated ids, over a tokenizer with
    `decode(ids) -> str`.

    push(token_id) returns the new text that token completes. It decodes a window (the tokens of the
    previous emission plus those not yet emitted) and emits what the window's text adds beyond the
    previous tokens' text; that handles tokenizers whose decode of a suffix differs from the suffix
    of a decode (SentencePiece drops a leading space at the start of a decode). While the window's
    text ends in U+FFFD, an incomplete UTF-8 sequence (a byte token of a multi-byte character),
    nothing is emitted. The pushes' concatenation equals tokenizer.decode(all ids) whenever that
    text is complete.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window start; end of the ids already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text.endswith(INCOMPLETE) or len(text) <= len(before):
            return ""  # incomplete character, or a token with no text (special)
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
