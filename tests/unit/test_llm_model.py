"""GPT-2 and Llama decoders in Hugging Face format: saving and loading (single file and sharded),
the reference forward with a KV cache against one full forward, bf16, the full-cache error, the
tokenizers, and logits against Hugging Face transformers' own models when that package is
installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serving.llm import (
    ByteTokenizer,
    KVCacheFullError,
    ModelLoadError,
    create_tiny_model,
    forward_tokens,
    load_model,
    load_tokenizer,
)
from serving.llm.model import INDEX_FILE, save_pretrained, weights_to_hf

FAMILIES = ["gpt2", "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(
        tmp_path_factory.mktemp(request.param) / "model", request.param, seed=7
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_round_trip_reproduces_saved_tensors(model_dir: Path) -> None:
    saved = load_file(str(model_dir / "model.safetensors"))
    model = load_model(model_dir)
    reloaded = weights_to_hf(model.config, model.weights)
    assert reloaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(reloaded[name], tensor), name


def test_config_is_normalised(model_dir: Path) -> None:
    config = load_model(model_dir).config
    assert (config.vocab_size, config.hidden, config.layers, config.heads) == (256, 64, 2, 4)
    assert config.kv_heads == (
        4 if config.family == "gpt2" else 2
    )  # llama uses grouped-query attention
    assert (config.rope_theta is None) == (config.family == "gpt2")


def test_seed_decides_the_weights(model_dir: Path, tmp_path: Path) -> None:
    family = load_model(model_dir).config.family
    same = load_file(str(create_tiny_model(tmp_path / "a", family, seed=7) / "model.safetensors"))
    other = load_file(str(create_tiny_model(tmp_path / "b", family, seed=8) / "model.safetensors"))
    saved = load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(same[k], saved[k]) for k in saved)
    head = "lm_head.weight" if family == "llama" else "transformer.wte.weight"
    assert not torch.equal(other[head], same[head])


def test_sharded_load_equals_single_file(model_dir: Path, tmp_path: Path) -> None:
    family = load_model(model_dir).config.family
    sharded = create_tiny_model(tmp_path / "sharded", family, seed=7, shards=3)
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()
    x = tokens(12, seed=1)
    assert torch.equal(
        forward_tokens(load_model(sharded), x), forward_tokens(load_model(model_dir), x)
    )


@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 3, 1], [9]])
def test_cached_decode_matches_full_forward(model_dir: Path, chunks: list[int]) -> None:
    model, x = load_model(model_dir), tokens(sum(chunks), seed=len(chunks))
    cache, start, parts = model.new_cache(32), 0, []
    for size in chunks:
        parts.append(forward_tokens(model, x[start : start + size], cache, start))
        start += size
    assert cache.length == x.shape[0]
    torch.testing.assert_close(torch.cat(parts), forward_tokens(model, x), rtol=1e-5, atol=1e-4)


def test_cache_rewind_overwrites_later_positions(model_dir: Path) -> None:
    model, x = load_model(model_dir), tokens(8, seed=3)
    cache = model.new_cache(16)
    forward_tokens(
        model, tokens(8, seed=4), cache, 0
    )  # a different continuation, then rolled back to 5
    forward_tokens(model, x[:5], cache, 0)
    torch.testing.assert_close(
        forward_tokens(model, x[5:], cache, 5), forward_tokens(model, x)[5:], rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_is_close_to_fp32(model_dir: Path, dtype: torch.dtype) -> None:
    x = tokens(10, seed=5)
    half = load_model(model_dir, dtype=dtype)
    assert all(t.dtype == dtype for t in half.weights.tensors())
    cache = half.new_cache(16)
    assert cache.pool.keys.dtype == dtype
    logits = torch.cat(
        [forward_tokens(half, x[:6], cache, 0), forward_tokens(half, x[6:], cache, 6)]
    )
    reference = forward_tokens(load_model(model_dir), x)
    scale = reference.abs().max()
    assert (logits - reference).abs().max() < 0.08 * scale
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8


def test_checkpoint_dtype_is_kept_by_default(model_dir: Path, tmp_path: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    tensors = {k: v.bfloat16() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    model = load_model(save_pretrained(tmp_path / "bf16", raw, tensors))
    assert model.dtype == torch.bfloat16
    assert load_model(tmp_path / "bf16", dtype="float32").dtype == torch.float32


def test_gpt2_hub_names_without_prefix_load(tmp_path: Path) -> None:
    # Checkpoints saved from GPT2Model (the hub's "gpt2") name tensors "h.0...", not
    # "transformer.h.0...".
    original = create_tiny_model(tmp_path / "a", "gpt2", seed=2)
    tensors = load_file(str(original / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    hub = save_pretrained(
        tmp_path / "hub", json.loads((original / "config.json").read_text()), renamed
    )
    x = tokens(6, seed=10)
    assert torch.equal(forward_tokens(load_model(hub), x), forward_tokens(load_model(original), x))


def test_full_cache_raises_with_sizes(model_dir: Path) -> None:
    model = load_model(model_dir)
    cache = model.new_cache(6)
    forward_tokens(model, tokens(4, seed=6), cache, 0)
    with pytest.raises(KVCacheFullError, match="holds 6 tokens.*needs 7"):
        forward_tokens(model, tokens(3, seed=7), cache, 4)
    assert cache.length == 4
    with pytest.raises(KVCacheFullError, match="128 positions"):
        forward_tokens(model, tokens(129, seed=8))


def test_missing_tensor_and_config_are_named(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    victim = sorted(tensors)[0]
    broken = tmp_path / "broken"
    save_pretrained(
        broken,
        json.loads((model_dir / "config.json").read_text()),
        {k: v for k, v in tensors.items() if k != victim},
    )
    with pytest.raises(ModelLoadError, match=victim.replace(".", r"\.")):
        load_model(broken)


def test_byte_tokenizer_round_trips_unicode(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, ByteTokenizer) and tok.eos_id == 0
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


@pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="`tokenizers` is not installed"
)
def test_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("world hello") == [1, 0] and tok.eos_id == 1


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="Hugging Face `transformers` is not installed (optional): logits not compared",
)
def test_logits_match_transformers(model_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32
    ).eval()
    x = tokens(20, seed=9)
    with torch.no_grad():
        expected = hf(x[None]).logits[0]
    torch.testing.assert_close(
        forward_tokens(load_model(model_dir), x), expected, rtol=1e-4, atol=1e-4
    )
