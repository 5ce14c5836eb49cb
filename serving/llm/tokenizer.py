"""Tokenizers of a model directory: Hugging Face `tokenizers` (tokenizer.json) when both the file and the
package exist, else a byte-level tokenizer (ids 0..255 are the UTF-8 bytes), which the tiny models use."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("gpuos.llm")


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    eos_id: int | None          # id that ends a completion; None when the model defines none

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 text; decoding replaces invalid sequences with U+FFFD."""

    def __init__(self, eos_id: int | None = 0) -> None:
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Raises ValueError for an id outside 0..255 (the model's vocabulary is larger than bytes)."""
        if bad := [i for i in ids if not 0 <= i < 256]:
            raise ValueError(f"byte tokenizer cannot decode ids {bad[:5]}: ids must be 0..255")
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; special tokens are kept out of decoded text."""

    def __init__(self, inner: Any, eos_id: int | None) -> None:
        self.inner, self.eos_id = inner, eos_id

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)


def _eos_id(path: Path) -> int | None:
    """eos_token_id of config.json (the first one when it lists several), or None."""
    config = path / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.exists() else None
    return eos[0] if isinstance(eos, list) else eos


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model directory; its eos id comes from config.json (bytes: 0 if absent)."""
    path, eos = Path(path), _eos_id(Path(path))
    if (path / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer as HFInner
        except ImportError:
            log.warning("%s has tokenizer.json but the `tokenizers` package is missing; using bytes", path)
        else:
            return HFTokenizer(HFInner.from_file(str(path / "tokenizer.json")), eos)
    return ByteTokenizer(0 if eos is None else eos)
