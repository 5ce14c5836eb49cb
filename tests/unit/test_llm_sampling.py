"""Sampling for the LLM engine: parameter validation, greedy / top-k / top-p / seeded draws and their
frequencies, stop strings over streamed text, and incremental detokenisation with the byte tokenizer
and real Hugging Face `tokenizers` BPE tokenizers trained here."""
from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from serving.llm import ByteTokenizer
from serving.llm.sampling import (Detokenizer, SamplingError, SamplingParams, StopMatcher, choose_tokens,
                                  make_generator)
from serving.llm.tokenizer import HFTokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "a streaming server sends tokens as they come",
          "every request samples with its own seed", "stop strings end a completion early"] * 20


# ------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 2.0), ("temperature", -0.1), ("temperature", 2.5),
    ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", True),
    ("seed", -1), ("seed", "7"), ("stop", ["a", "b", "c", "d", "e"]), ("stop", ["ok", ""]),
    ("stop", [3]), ("stop", 3)])
def test_bad_field_raises_naming_it(field: str, value: object) -> None:
    with pytest.raises(SamplingError, match=field) as error:
        SamplingParams(**{field: value})
    assert isinstance(error.value, ValueError)


def test_stop_is_a_tuple_whatever_was_given() -> None:
    assert SamplingParams(stop=["\n\n", "END"]).stop == ("\n\n", "END")
    assert SamplingParams(stop="END").stop == ("END",)   # one string is one stop, not its characters
    assert SamplingParams(stop=None).stop == ()
    hash(SamplingParams(stop=["x"]))                       # usable as a key once converted


def test_boundary_values_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, seed=0, stop=["a"] * 4)
    SamplingParams(temperature=2, top_p=1e-9, seed=2**64 - 1)


# ----------------------------------------------------------------------------------------- sampling
def choose(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """choose_tokens as the engine calls it: probs = softmax(logits / temperature) per row."""
    temps = torch.tensor([[p.temperature or 1.0] for p in params])
    return choose_tokens(logits, torch.softmax(logits / temps, dim=-1), params, gens)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> list[int]:
    """n tokens drawn from one distribution in one batch, all rows sharing one seeded generator."""
    return choose(logits.expand(n, -1), [params] * n, [make_generator(seed)] * n)


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_needs_no_probs() -> None:
    logits = random_logits(8, 100, seed=0)
    params = [SamplingParams(temperature=0)] * 8
    gens = [make_generator(i) for i in range(8)]
    assert choose_tokens(logits, None, params, gens) == logits.argmax(-1).tolist()


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    logits = random_logits(6, 100, seed=1)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(6)]
    tokens = choose(logits, params, [make_generator(i) for i in range(6)])
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()
    assert all(isinstance(t, int) and 0 <= t < 100 for t in tokens)


@pytest.mark.parametrize("temperature", [0.1, 1.0, 2.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = random_logits(64, 50, seed=2)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 64
    assert choose(logits, params, [make_generator(i) for i in range(64)]) == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(1, 50, seed=3) * 0.1    # nearly flat: without top_p any token is likely
    assert set(draws(logits, SamplingParams(top_p=1e-6), 500, seed=3)) == {int(logits.argmax())}


def test_top_k_never_leaves_the_top_k() -> None:
    logits = random_logits(1, 50, seed=4) * 0.5
    tokens = draws(logits, SamplingParams(top_k=5), 3000, seed=4)
    assert set(tokens) == set(logits[0].topk(5).indices.tolist())   # all 5 occur, nothing else


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    tokens = draws(logits, SamplingParams(top_p=0.75), 4000, seed=5)
    assert set(tokens) == {0, 1}                                  # 0.5 < 0.75 <= 0.8
    assert tokens.count(0) / len(tokens) == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_p_measures_mass_after_top_k() -> None:
    # after top_k=2 the kept tokens hold 0.625 and 0.375, so top_p=0.6 keeps only the first; measured
    # against the original distribution (0.5 < 0.6) it would keep both
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert set(draws(logits, SamplingParams(top_k=2, top_p=0.6), 500, seed=6)) == {0}


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    logits = random_logits(1, 50, seed=7)
    params = SamplingParams(seed=11)
    first, again = draws(logits, params, 200, seed=11), draws(logits, params, 200, seed=11)
    assert first == again
    assert draws(logits, params, 200, seed=12) != first
    assert draws(logits, params, 200, seed=None) != draws(logits, params, 200, seed=None)


def test_a_rows_tokens_do_not_depend_on_its_batch() -> None:
    logits = random_logits(4, 50, seed=8)
    params = [SamplingParams(top_k=10)] * 4
    alone = [choose(logits[:1], params[:1], [make_generator(3)])[0] for _ in range(20)]
    batched = [choose(logits, params, [make_generator(3)] + [make_generator(i) for i in range(3)])[0]
               for _ in range(20)]
    assert alone == batched


def test_frequencies_match_probabilities() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    tokens = torch.tensor(draws(probs.log()[None], SamplingParams(), n, seed=9))
    observed = torch.bincount(tokens, minlength=4).double()
    chi2 = float(((observed - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 25   # 3 degrees of freedom: p < 1e-4 for a correct sampler


def test_temperature_comes_from_the_callers_probs() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])               # 1:3 at temperature 1
    n = 8000
    tokens = draws(logits, SamplingParams(temperature=2.0), n, seed=10)  # 1:sqrt(3) at temperature 2
    assert tokens.count(1) / n == pytest.approx(math.sqrt(3) / (1 + math.sqrt(3)), abs=0.03)


def test_mismatched_batch_is_refused() -> None:
    logits = random_logits(3, 10, seed=0)
    with pytest.raises(SamplingError, match="one params and one generator per logits row"):
        choose_tokens(logits, None, [SamplingParams(temperature=0)] * 2, [make_generator(0)] * 3)
    with pytest.raises(SamplingError, match="probs is None"):
        choose_tokens(logits, None, [SamplingParams()] * 3, [make_generator(0)] * 3)


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
    assert matcher.feed("xaa") == ("x", False)       # "a" and "aa" could both start the stop
    assert matcher.feed("b") == ("", True)


def test_flush_returns_held_text() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("done </e") == ("done ", False)
    assert matcher.flush() == "</e"


def test_earliest_of_several_stops_wins() -> None:
    assert StopMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    matcher = StopMatcher(["zzz", "o w"])
    assert matcher.feed("hello") == ("hell", False)
    assert matcher.feed(" wzzz") == ("", True)         # "o w" starts before "zzz"


def test_no_stops_passes_text_through() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize("text", ["the answer is 42.\n\nQ: next", "no stop here, only \n single"])
def test_every_split_emits_the_text_before_the_stop(text: str) -> None:
    stops = ["\n\n", "Q:"]
    expected = text[:text.index("\n\n")] if "\n\n" in text else text
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
def push_all(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def test_byte_tokens_of_multibyte_characters() -> None:
    text, tokenizer = "héllo wörld ✓", ByteTokenizer()
    pieces = push_all(Detokenizer(tokenizer), tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["h", "", "é"]           # the first byte of é emits nothing


def train(pre_tokenizer: object, decoder: object, alphabet: list[str]) -> HFTokenizer:
    inner = Tokenizer(models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer, inner.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=alphabet, show_progress=False)
    inner.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(inner, inner.token_to_id("</s>"))


def test_hf_byte_level_bpe_round_trip() -> None:
    # GPT-2 style: é, ö and ✓ are not in the corpus, so they are split into byte tokens
    tokenizer = train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                      pre_tokenizers.ByteLevel.alphabet())
    text = "the quick fox says héllo wörld ✓ to every request"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)   # the test does cross partial characters
    pieces = push_all(Detokenizer(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_hf_sentencepiece_style_bpe_round_trip() -> None:
    # Llama style: decoding a token alone drops its leading space, so per-token decoding would glue words
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
