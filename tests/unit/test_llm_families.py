"""Model families on the one forward, against Hugging Face `transformers` itself: tiny random Llama
models with every supported `rope_scaling` type (hub config.json format and transformers 5's
`rope_parameters`), Qwen2 (q/k/v biases, tied embeddings) and Mistral (sliding window) built and
saved with transformers, loaded here, logits compared; the engine on the runtime (its device
program: biased projections, scaled rotary tables) against the reference forward; unsupported
configs named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuos_core import Runtime
from serving.llm import ByteTokenizer, ModelLoadError, forward_tokens, load_model
from serving.llm.engine import Engine, EngineConfig
from serving.llm.model import parse_config
from serving.llm.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# config.json as the hub has them (rope_theta + rope_scaling); transformers reads the same file
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "llama-llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-biased": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": (
        "qwen2",
        {"tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 8},
    ),
    "mistral": ("mistral", {"sliding_window": 48, "head_dim": 16}),
}
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def build(path: Path, model_type: str, extra: dict[str, Any], hub_format: bool = True) -> Path:
    """A tiny random transformers model saved at `path` (safetensors). Every parameter is random,
    biases and norms included, so a mismapped tensor shows in the logits."""
    raw = {
        "model_type": model_type,
        "architectures": [CLASSES[model_type]],
        **SHAPE,
        "rope_theta": 10000.0,
        **extra,
    }
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(len(path.name))
    model = getattr(transformers, CLASSES[model_type])(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if "norm" in name
                else torch.randn_like(p) / fan_in**0.5
                if p.dim() > 1
                else 0.1 * torch.randn_like(p)
            )
    model.save_pretrained(path)
    if hub_format:  # transformers 5 writes rope_parameters; the hub's files have the old keys
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name, kind, extra) for name, (kind, extra) in CASES.items()}


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens[None]).logits[0]


def tokens(n: int) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(models: dict[str, Path], case: str) -> None:
    model = load_model(models[case])
    x = tokens(40)  # past original_max (16/32) where the scaling types differ from plain rope
    torch.testing.assert_close(
        forward_tokens(model, x), hf_logits(models[case], x), rtol=1e-4, atol=1e-4
    )


def test_config_is_read(models: dict[str, Path]) -> None:
    llama3 = load_model(models["llama-llama3"]).config
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling is not None
    assert (llama3.rope_scaling.kind, llama3.rope_scaling.factor) == ("llama3", 8.0)
    qwen = load_model(models["qwen2"])
    assert qwen.config.model_type == "qwen2" and qwen.weights.lm_head is qwen.weights.embed
    layer = qwen.weights.layers[0]
    assert layer.qkv.bias is not None and layer.o.bias is None  # qwen2: q/k/v biased only
    assert qwen.config.max_positions == 64  # use_sliding_window false: the window is off
    assert load_model(models["mistral"]).config.max_positions == 48  # limited to the window


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    path = build(tmp_path / "v5", "llama", {"rope_scaling": LLAMA3}, hub_format=False)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    x = tokens(40)
    torch.testing.assert_close(
        forward_tokens(load_model(path), x), hf_logits(path, x), rtol=1e-4, atol=1e-4
    )


def test_sharded_bf16_load_casts_as_it_reads(models: dict[str, Path], tmp_path: Path) -> None:
    source = transformers.AutoModelForCausalLM.from_pretrained(models["qwen2"])
    source.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load_model(tmp_path / "sharded", dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in model.weights.tensors())
    x = tokens(12)
    reference = forward_tokens(load_model(models["qwen2"]), x)
    assert (forward_tokens(model, x) - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"model_type": "gemma"}, "gemma"),
    ],
)
def test_unsupported_configs_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        parse_config({"model_type": "llama", **SHAPE, **change})


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    with Runtime("cpu") as rt:
        yield rt


@pytest.mark.parametrize("case", ["qwen2", "llama-llama3", "llama-yarn"])
def test_engine_program_equals_the_reference(
    models: dict[str, Path], runtime: Runtime, case: str
) -> None:
    """The device program (biased qkv linear, scaled rotary tables) against forward_tokens."""
    model = load_model(models[case])
    engine = Engine(
        model, ByteTokenizer(eos_id=None), runtime, EngineConfig(max_running=2, max_step_tokens=64)
    )
    try:
        prompts = [tokens(30).tolist(), tokens(7).tolist()]
        params = SamplingParams(max_tokens=4, temperature=0.0)
        streams = [engine.submit(p, params, keep_logits=True) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert list(stream)[-1].error is None
            sequence = torch.tensor(prompt + stream.tokens[:-1])
            expected = forward_tokens(model, sequence)[len(prompt) - 1 :]
            assert stream.logits is not None
            torch.testing.assert_close(torch.stack(stream.logits), expected, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()
