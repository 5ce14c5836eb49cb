"""Tokenizer, generation config and chat template of a model directory against Hugging Face
`transformers` (AutoTokenizer, apply_chat_template) for a small BPE tokenizer built here: BOS as
tokenizer_config.json says, special tokens in text, decoding without them, streamed decoding, every
EOS id of generation_config.json, sampling defaults; the tiny models' own chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from serving.llm import create_tiny_model, load_tokenizer
from serving.llm.chat import ChatTemplateError, load_chat_template
from serving.llm.tokenizer import HFTokenizer, load_generation_config

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ünïcode ✓ and emoji 🦊",
    "Hello, how are you today? I am fine, thank you.",
] * 20


def make(path: Path, tokenizer_config: dict[str, Any]) -> Path:
    """tokenizer.json (byte-level BPE whose post-processor adds <s>) and the config files."""
    path.mkdir(parents=True, exist_ok=True)
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    inner.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", inner.token_to_id("<s>"))]
    )
    inner.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": {"__type": "AddedToken", "content": "<unk>"},
                "chat_template": TEMPLATE,
                **tokenizer_config,
            }
        )
    )
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 4], "do_sample": True, "temperature": 0.6, "top_p": 0.9})
    )
    return path


TEXTS = ["Hello, how are you?", "héllo wörld 🦊", "<|im_start|>user\nhi<|im_end|>", " lazy  dog "]


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_encode_and_decode_equal_transformers(tmp_path: Path, add_bos: bool | None) -> None:
    path = make(tmp_path, {} if add_bos is None else {"add_bos_token": add_bos})
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert (
            ours.encode(text, add_special_tokens=False)
            == hf(text, add_special_tokens=False)["input_ids"]
        )
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode("hi")[0] == 1  # tokenizer.json's post-processor adds BOS, as transformers


def test_streamed_text_equals_decode(tmp_path: Path) -> None:
    tok = load_tokenizer(make(tmp_path, {}))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("héllo wörld 🦊 <|im_end|> The quick brown fox", add_special_tokens=False)
    stream = tok.detokenizer()
    assert "".join(stream.push(i) for i in ids) == tok.decode(ids)


def test_eos_ids_and_generation_defaults(tmp_path: Path) -> None:
    path = make(tmp_path, {})
    tok = load_tokenizer(path)
    assert tok.eos_id == 2 and tok.eos_ids == {2, 4} and tok.bos_id == 1
    assert load_generation_config(path).defaults() == {"temperature": 0.6, "top_p": 0.9}
    (path / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.6})
    )
    assert load_generation_config(path).defaults() == {}


def test_chat_template_equals_transformers(tmp_path: Path) -> None:
    path = make(tmp_path, {})
    hf = transformers.AutoTokenizer.from_pretrained(path)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✓"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Fox?"},
    ]
    template = load_chat_template(path)
    assert template is not None
    text = template.render(chat)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = load_tokenizer(path).encode(text, add_special_tokens=False)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(3) == 5  # the template's BOS once; <|im_start|> as its id


def test_template_errors_and_other_sources(tmp_path: Path) -> None:
    path = make(tmp_path, {"chat_template": "{{ raise_exception('roles must alternate') }}"})
    template = load_chat_template(path)
    assert template is not None
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    assert load_chat_template(path).render([{"role": "user", "content": "é<"}]) == '"é<"'
    (path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):  # the sandbox: no way out through attributes
        load_chat_template(path).render([{"role": "user", "content": "x"}])


def test_tiny_models_have_a_chat_template(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "tiny", "gpt2")
    template = load_chat_template(path)
    assert template is not None
    assert template.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    assert load_chat_template(tmp_path) is None
