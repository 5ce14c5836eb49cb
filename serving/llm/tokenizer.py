"""Tokenizers of a model directory, and its generation config.

Hugging Face `tokenizers` (tokenizer.json) when the directory has one, else a byte-level tokenizer
(ids
0..255 are the UTF-8 bytes), which the tiny models use. What the files around them say is applied as
`transformers` applies it:
- `tokenizer.json`'s post-processor adds the special tokens a prompt starts with (Llama's BOS) to a
  completion prompt; as in transformers 5, `add_bos_token` of tokenizer_config.json changes nothing
  (a chat prompt is encoded without them: its template writes the BOS);
- `tokenizer_config.json`: `bos_token` / `eos_token` (strings, or `{"content": ...}`);
- `generation_config.json`: `eos_token_id` (one id or a list: every one ends a completion, with
  config.json's and the tokenizer's EOS token), and the sampling defaults `temperature`, `top_p`,
  `top_k` that a request leaving them out gets.

Special tokens written in a prompt's text (e.g. `<|im_start|>`) encode as their ids, as with the
Hugging
Face tokenizer; decoded text leaves every special token out. Text is streamed through
`tokenizers.decoders.DecodeStream` (`detokenizer()`), which decodes each new token in constant time.
"""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from serving.llm.sampling import Detokenizer

log = logging.getLogger("gpuos.llm")


class TextStream(Protocol):
    """Incremental detokenisation of one request: `push(id)` returns the text that id completes."""

    def push(self, token_id: int) -> str: ...


class Tokenizer(Protocol):
    """What the engine and the API need of a tokenizer."""

    eos_id: int | None  # the main id that ends a completion; None when the model has none
    eos_ids: frozenset[int]  # every id that ends a completion (eos_id among them)
    bos_id: int | None  # beginning-of-sequence id, if the model has one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; with `add_special_tokens` the BOS token (etc.) a prompt starts with."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out."""
        ...

    def detokenizer(self) -> TextStream:
        """A fresh incremental decoder for one request's generated ids."""
        ...


class ByteTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 text; decoding replaces invalid sequences with
    U+FFFD."""

    bos_id: int | None = None

    def __init__(self, eos_id: int | None = 0, eos_ids: frozenset[int] | None = None) -> None:
        self.eos_id = eos_id
        self.eos_ids = frozenset(eos_ids or ()) | ({eos_id} if eos_id is not None else set())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Raises ValueError for an id outside 0..255 (the model's vocabulary is larger than
        bytes)."""
        if bad := [i for i in ids if not 0 <= i < 256]:
            raise ValueError(f"byte tokenizer cannot decode ids {bad[:5]}: ids must be 0..255")
        return bytes(ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> TextStream:
        return _ByteStream()


class _ByteStream:
    """A TextStream of byte ids: UTF-8 decoded incrementally, a character once its last byte
    comes (constant time a token, as `Detokenizer`'s two decodes of a window are not)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Raises ValueError for an id outside 0..255, as ByteTokenizer.decode does."""
        if not 0 <= token_id < 256:
            raise ValueError(f"byte tokenizer cannot decode id {token_id}: ids must be 0..255")
        return self._decoder.decode(bytes((token_id,)))


class _DecodeStream:
    """A TextStream over `tokenizers.decoders.DecodeStream` (special tokens skipped)."""

    def __init__(self, inner: Any, stream: Any) -> None:
        self.inner, self.stream = inner, stream

    def push(self, token_id: int) -> str:
        return self.stream.step(self.inner, token_id) or ""


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json, with the BOS/EOS ids of the files beside
    it."""

    def __init__(
        self,
        inner: Any,
        eos_id: int | None,
        eos_ids: frozenset[int] | None = None,
        bos_id: int | None = None,
    ) -> None:
        self.inner, self.eos_id, self.bos_id = inner, eos_id, bos_id
        self.eos_ids = frozenset(eos_ids or ()) | ({eos_id} if eos_id is not None else set())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """With `add_special_tokens`, tokenizer.json's post-processor adds what a prompt starts with
        (Llama's BOS), as transformers 5 does whatever `add_bos_token` says."""
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.inner.decode(ids, skip_special_tokens=True))

    def detokenizer(self) -> TextStream:
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return Detokenizer(self)
        return _DecodeStream(self.inner, DecodeStream(skip_special_tokens=True))


@dataclass(frozen=True)
class GenerationConfig:
    """What `generation_config.json` says a completion defaults to (None: not given there)."""

    eos_ids: frozenset[int] = frozenset()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def defaults(self) -> dict[str, Any]:
        """Sampling defaults a request that leaves them out gets (only those the file gives)."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {k: v for k, v in given.items() if v is not None}


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is absent."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> frozenset[int]:
    """An eos_token_id field (an id, a list of ids, or null) as a set."""
    if value is None:
        return frozenset()
    return frozenset(int(v) for v in (value if isinstance(value, list) else [value]))


def token_string(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_generation_config(path: str | Path) -> GenerationConfig:
    """generation_config.json of a model directory (all fields None when it has none)."""
    raw = _json(Path(path) / "generation_config.json")
    sampled = raw.get("do_sample")
    temperature = raw.get("temperature")
    if sampled is False and temperature is not None:
        temperature = None  # transformers ignores the sampling knobs when do_sample is false
    top_p, top_k = (raw.get(k) if sampled is not False else None for k in ("top_p", "top_k"))
    return GenerationConfig(
        _ids(raw.get("eos_token_id")),
        float(temperature) if temperature is not None else None,
        float(top_p) if top_p is not None else None,
        int(top_k) if top_k is not None else None,
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model directory. Its stop ids: generation_config.json's eos_token_id(s),
    config.json's and tokenizer_config.json's `eos_token` (bytes: 0 if none is given)."""
    path = Path(path)
    config, tok_config = _json(path / "config.json"), _json(path / "tokenizer_config.json")
    config_eos = config.get("eos_token_id")
    first = config_eos[0] if isinstance(config_eos, list) and config_eos else config_eos
    eos_ids = _ids(config_eos) | load_generation_config(path).eos_ids
    if not (path / "tokenizer.json").exists():
        byte_eos = first if isinstance(first, int) else (min(eos_ids) if eos_ids else 0)
        return ByteTokenizer(byte_eos, eos_ids)
    from tokenizers import Tokenizer as HFInner

    inner = HFInner.from_file(str(path / "tokenizer.json"))

    def special(name: str) -> int | None:
        text = token_string(tok_config.get(name))
        return inner.token_to_id(text) if text is not None else None

    eos_token, bos = special("eos_token"), special("bos_token")
    config_bos = config.get("bos_token_id")
    if bos is None and "bos_token" not in tok_config and isinstance(config_bos, int):
        bos = config_bos
    eos = eos_token if eos_token is not None else (first if isinstance(first, int) else None)
    eos_ids |= {eos} if eos is not None else set()
    return HFTokenizer(inner, eos, eos_ids, bos)
