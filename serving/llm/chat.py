"""Chat templates: a model's conversation format, rendered from messages into the prompt text, as
`transformers`' `apply_chat_template(..., tokenize=False)` renders it.

The template is the Jinja2 source a model directory ships: `chat_template.jinja`,
`chat_template.json`
(`{"chat_template": ...}`) or the `chat_template` of `tokenizer_config.json` (a string, or a list of
named templates of which `default` is used). It runs in Jinja2's immutable sandbox (a template from
the Hub is untrusted code) with transformers' environment: `trim_blocks`, `lstrip_blocks`, loop
controls, a `tojson` that does not escape HTML, `raise_exception` and `strftime_now`, and the
special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...) as variables. The rendered
text is encoded without adding special tokens (the template writes the BOS token itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.llm.tokenizer import token_string

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the model's template does not compile, or it refused them
    (e.g. roles that do not alternate). The API answers it as a bad `messages` (400)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A model's chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self.template = _compile(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text of `messages` ({"role", "content", ...} each); with
        `add_generation_prompt`, ending where the assistant's answer begins. ChatTemplateError
        says why the template refused them."""
        try:
            return self.template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"the model's chat template refused the messages: {exc}"
            ) from None


def _source(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template's Jinja source shipped in a model directory, or None."""
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").exists():
        raw = json.loads((path / "chat_template.json").read_text(encoding="utf-8"))
        if isinstance(raw, dict) and isinstance(raw.get("chat_template"), str):
            return str(raw["chat_template"])
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template of a model directory with tokenizer_config.json's special tokens, or None
    when the directory has none (a base model: /v1/chat/completions then answers 400)."""
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    source = _source(path, config)
    if source is None:
        return None
    specials = {
        name: text
        for name in SPECIAL_TOKENS
        if (text := token_string(config.get(name))) is not None
    }
    return ChatTemplate(source, specials)


def message_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's content as text: a string, or the `text` parts of a list of content parts
    joined (OpenAI's `[{"type": "text", "text": ...}]`)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
