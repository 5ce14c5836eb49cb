"""Sampling for the LLM engine: parameter validation, stop strings over streamed text, and
incremental detokenisation with the byte tokenizer and real Hugging Face `tokenizers` BPE tokenizers
trained here.
(The draw itself, greedy / top-k / top-p / seeded, is sample_tokens: test_device_sampling.py.)"""

from __future__ import annotations

import math

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from serving.llm import ByteTokenizer
from serving.llm.sampling import Detokenizer, SamplingError, SamplingParams, StopMatcher
from serving.llm.tokenizer import HFTokenizer, TextStream

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a streaming server sends tokens as they come",
    "every request samples with its own seed",
    "stop strings end a completion early",
] * 20


# ------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", True),
        ("seed", -1),
        ("seed", "7"),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", ["ok", ""]),
        ("stop", [3]),
        ("stop", 3),
    ],
)
def test_bad_field_raises_naming_it(field: str, value: object) -> None:
    with pytest.raises(SamplingError, match=field) as error:
        SamplingParams(**{field: value})
    assert isinstance(error.value, ValueError)


def test_stop_is_a_tuple_whatever_was_given() -> None:
    assert SamplingParams(stop=["\n\n", "END"]).stop == ("\n\n", "END")
    assert SamplingParams(stop="END").stop == ("END",)  # one string is one stop, not its characters
    assert SamplingParams(stop=None).stop == ()
    hash(SamplingParams(stop=["x"]))  # usable as a key once converted


def test_boundary_values_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, seed=0, stop=["a"] * 4)
    SamplingParams(temperature=2, top_p=1e-9, seed=2**64 - 1)


# ------------------------------------------------------------------------------------ stop strings
def test_stop_inside_one_delta() -> None:
    assert StopMatcher(["STOP"]).feed("hello STOP world") == ("hello ", True)


def test_stop_split_across_deltas() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P and more") == ("", True)


def test_partial_prefix_is_released_when_it_does_not_complete() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("AR") == ("STAR", False)


def test_overlapping_prefix_holds_the_longest_candidate() -> None:
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xaa") == ("x", False)  # "a" and "aa" could both start the stop
    assert matcher.feed("b") == ("", True)


def test_flush_returns_held_text() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("done </e") == ("done ", False)
    assert matcher.flush() == "</e"


def test_earliest_of_several_stops_wins() -> None:
    assert StopMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    matcher = StopMatcher(["zzz", "o w"])
    assert matcher.feed("hello") == ("hell", False)
    assert matcher.feed(" wzzz") == ("", True)  # "o w" starts before "zzz"


def test_no_stops_passes_text_through() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize("text", ["the answer is 42.\n\nQ: next", "no stop here, only \n single"])
def test_every_split_emits_the_text_before_the_stop(text: str) -> None:
    stops = ["\n\n", "Q:"]
    expected = text[: text.index("\n\n")] if "\n\n" in text else text
    for cut in range(len(text) + 1):
        for deltas in ([text[:cut], text[cut:]], list(text)):
            matcher, out, found = StopMatcher(stops), "", False
            for delta in deltas:
                piece, found = matcher.feed(delta)
                out += piece
                if found:
                    break
            assert (out if found else out + matcher.flush()) == expected
            assert found == ("\n\n" in text)


# ---------------------------------------------------------------------------------- detokenisation
def push_all(detok: TextStream, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


@pytest.mark.parametrize("stream", ["window", "bytes"])
def test_byte_tokens_of_multibyte_characters(stream: str) -> None:
    text, tokenizer = "héllo wörld ✓", ByteTokenizer()
    detok = Detokenizer(tokenizer) if stream == "window" else tokenizer.detokenizer()
    pieces = push_all(detok, tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["h", "", "é"]  # the first byte of é emits nothing


def test_byte_stream_replaces_invalid_bytes_as_decode_does() -> None:
    tokenizer = ByteTokenizer()
    ids = [0xFF, 0x41, 0xC3, 0x42, 0xE2, 0x9C, 0x93]  # a stray byte, a cut sequence, then ✓
    assert "".join(push_all(tokenizer.detokenizer(), ids)) == tokenizer.decode(ids)
    with pytest.raises(ValueError, match="0..255"):
        tokenizer.detokenizer().push(256)


def train(pre_tokenizer: object, decoder: object, alphabet: list[str]) -> HFTokenizer:
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer, inner.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    inner.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(inner, inner.token_to_id("</s>"))


def test_hf_byte_level_bpe_round_trip() -> None:
    # GPT-2 style: é, ö and ✓ are not in the corpus, so they are split into byte tokens
    tokenizer = train(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        pre_tokenizers.ByteLevel.alphabet(),
    )
    text = "the quick fox says héllo wörld ✓ to every request"
    ids = tokenizer.encode(text)
    assert any(
        "\ufffd" in tokenizer.decode([i]) for i in ids
    )  # the test does cross partial characters
    pieces = push_all(Detokenizer(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_hf_sentencepiece_style_bpe_round_trip() -> None:
    # Llama style: decoding a token alone drops its leading space, so per-token decoding would glue
    # words
    tokenizer = train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [])
    text = "the lazy dog sends tokens as they come"
    ids = tokenizer.encode(text)
    assert "".join(tokenizer.decode([i]) for i in ids) != text
    assert "".join(push_all(Detokenizer(tokenizer), ids)) == tokenizer.decode(ids) == text


def test_special_tokens_emit_nothing() -> None:
    tokenizer = train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [])
    head = tokenizer.encode("the quick fox")
    ids = head + [tokenizer.eos_id] + tokenizer.encode("jumps over")
    pieces = push_all(Detokenizer(tokenizer), ids)
    assert pieces[len(head)] == ""
    assert "".join(pieces) == tokenizer.decode(ids) == "the quick fox jumps over"
