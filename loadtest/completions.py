"""The completions scenario's requests and checks (OpenAI's /v1/completions shape), without Locust:
locustfile.py sends and times the requests, run.py reads the names and the token counts.

Checks are structural (sampled answers differ from run to run): one choice of text, a finish
reason of stop or length, no more tokens than max_tokens, usage that adds up, no stop sequence in
the text; a stream is JSON chunks on `data:` lines, exactly one (the last) with a finish reason,
then `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMPLETION = "completions"  # Locust entry of non-streaming requests
STREAM = "completions stream"  # Locust entry of streams, whole-stream time
TTFT = "completions stream TTFT"  # Locust entry of streams' time to first token
MEASURES = frozenset({TTFT})  # entries that time part of a request, not a request
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "In 1969, the first humans to walk on the Moon",
    "A haiku about autumn leaves:\n",
    "The quick brown fox",
)
STOP = "\n\n"
MAX_TOKENS, STREAM_FRACTION = 16, 0.5  # defaults of --max-tokens and --stream-fraction
FINISH_REASONS = frozenset({"stop", "length"})
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the half of the requests that is not greedy


@dataclass
class Generated:
    """Tokens of the answers that passed their checks: what the locustfile's --tokens-out holds."""

    model: str = ""
    completion_tokens: int = 0  # non-streaming answers' usage.completion_tokens
    stream_tokens: int = 0  # streams' chunks with text

    @property
    def tokens(self) -> int:
        return self.completion_tokens + self.stream_tokens


def completion_request(
    model: str, prompt: str, max_tokens: int, stream: bool, greedy: bool, seed: int
) -> dict[str, Any]:
    """A /v1/completions body: greedy (temperature 0) or sampled with `seed`, stopping at STOP."""
    sampling = {"temperature": 0.0} if greedy else {**SAMPLED, "seed": seed}
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stop": [STOP],
        "stream": stream,
        **sampling,
    }


def model_id(body: Any) -> str:
    """The first model of a GET /v1/models answer; ValueError saying why there is none."""
    data = body.get("data") if isinstance(body, Mapping) and body.get("object") == "list" else None
    if not (
        isinstance(data, list)
        and data
        and isinstance(data[0], Mapping)
        and isinstance(data[0].get("id"), str)
    ):
        raise ValueError(f"no model in {json.dumps(body)[:200]}")
    return data[0]["id"]


def completion_problem(body: Any, model: str, max_tokens: int) -> str | None:
    """What is wrong with a non-streaming answer, or None."""
    problem = shape_problem(body, model)
    if problem:
        return problem
    choice = body["choices"][0]
    if choice.get("finish_reason") not in FINISH_REASONS:
        return f"finish_reason {choice.get('finish_reason')!r}"
    if STOP in choice["text"]:
        return f"the stop sequence {STOP!r} is in the text"
    return usage_problem(body.get("usage"), max_tokens)


def shape_problem(body: Any, model: str) -> str | None:
    """What is wrong with an answer's or a chunk's envelope (object, model, one text choice)."""
    if not isinstance(body, Mapping):
        return f"not a JSON object: {json.dumps(body)[:80]}"
    if body.get("object") != "text_completion":
        return f"object {body.get('object')!r}"
    if body.get("model") != model:
        return f"model {body.get('model')!r}, asked for {model!r}"
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return f"{len(choices) if isinstance(choices, list) else 'no'} choices, want 1"
    if not isinstance(choices[0], Mapping) or not isinstance(choices[0].get("text"), str):
        return f"choice {choices[0]!r} has no text"
    return None


def usage_problem(usage: Any, max_tokens: int) -> str | None:
    """What is wrong with a `usage` object: completion_tokens <= max_tokens, total = sum."""
    if not isinstance(usage, Mapping):
        return f"usage {usage!r}"
    prompt, completion, total = (
        usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    )
    if not all(isinstance(n, int) and n >= 0 for n in (prompt, completion, total)):
        return f"usage {dict(usage)}"
    if completion > max_tokens:
        return f"{completion} completion tokens > max_tokens {max_tokens}"
    if total != prompt + completion:
        return f"total_tokens {total} != {prompt} + {completion}"
    return None


class CompletionStream:
    """Checks a streaming answer line by line as it arrives: feed() every line, then verdict()."""

    def __init__(self, model: str, max_tokens: int) -> None:
        self.model, self.max_tokens = model, max_tokens
        self.tokens = 0  # chunks whose text is not empty
        self.text = ""
        self.finish: str | None = None  # the finish reason, once a chunk gave one
        self.done = False  # `data: [DONE]` seen
        self.problem: str | None = None  # the first thing found wrong

    def feed(self, line: str) -> bool:
        """Take one line of the event stream; True when it is a chunk carrying text (a token).
        Blank lines, comments and other SSE fields are skipped; after a problem, everything."""
        if self.problem or not line.startswith("data:"):
            return False
        data = line[5:].removeprefix(" ")
        if self.done:
            self.problem = f"data after [DONE]: {data[:80]!r}"
        elif data == "[DONE]":
            self.done = True
        else:
            return self.take(data)
        return False

    def take(self, data: str) -> bool:
        """Check one chunk; True when it carries text."""
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        self.problem = (
            self.chunk_problem(chunk)
            if isinstance(chunk, dict)
            else f"chunk is not a JSON object: {data[:80]!r}"
        )
        if self.problem:
            return False
        choice = chunk["choices"][0]
        self.finish = choice.get("finish_reason")
        self.text += choice["text"]
        self.tokens += bool(choice["text"])
        return bool(choice["text"])

    def chunk_problem(self, chunk: Mapping[str, Any]) -> str | None:
        """What is wrong with one chunk, given the chunks before it."""
        problem = shape_problem(chunk, self.model)
        if problem:
            return problem
        if self.finish:
            return f"a chunk after the one with finish_reason {self.finish!r}"
        reason = chunk["choices"][0].get("finish_reason")
        if reason is not None and reason not in FINISH_REASONS:
            return f"finish_reason {reason!r}"
        return usage_problem(chunk["usage"], self.max_tokens) if chunk.get("usage") else None

    def verdict(self) -> str | None:
        """What is wrong with the whole stream, or None."""
        if self.problem:
            return self.problem
        if not self.done:
            return "the stream ended without data: [DONE]"
        if self.finish is None:
            return "no chunk has a finish_reason"
        if self.tokens > self.max_tokens:
            return f"{self.tokens} text chunks > max_tokens {self.max_tokens}"
        if STOP in self.text:
            return f"the stop sequence {STOP!r} is in the text"
        return None
