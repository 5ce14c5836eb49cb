"""Decoder-only transformers in Hugging Face format: configs, weights, KV caches and the torch
reference functions of their layers.

Families (config.json `model_type`): `gpt2`, and the Llama layout: `llama` (Llama 1/2/3.x, with
`rope_scaling` types `linear`, `dynamic`, `llama3` and `yarn`), `mistral` and `qwen2` (q/k/v biases,
tied embeddings). A model directory holds `config.json` and `*.safetensors` (one file, or shards
listed
by `model.safetensors.index.json`) with Hugging Face tensor names. Every family is normalised into
one
`ModelConfig` and one `Weights` layout (every projection a `Linear` with torch's [out, in] weight
and
optional bias; q/k/v fused into one `qkv`, gate/up fused into one `up`), so the engine runs one code
path. Tensors are read, cast and fused one layer at a time, so loading peaks at about one copy of
the
weights (plus one layer).

The reference functions (`rms_norm`, `layer_norm`, `apply_rotary`, `attend`) take stacked rows and
explicit positions; the forward over them is written once in forward.py. Torch only: Hugging Face
`transformers` is never imported here.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from gpuos_core.errors import GpuosError
from gpuos_core.families import gate_up

log = logging.getLogger("gpuos.llm")

INDEX_FILE = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# GPT-2 activation names of Hugging Face mapped to F.gelu's `approximate` argument ("tanh" is
# gelu_new).
GPT2_GELU: dict[str, str] = {
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_fast": "tanh",
    "gelu": "none",
}


class ModelLoadError(GpuosError, ValueError):
    """A model directory is missing a file or tensor, or uses a feature this loader does not
    support."""


class KVCacheFullError(GpuosError, RuntimeError):
    """A request's KV cache (or the model's positions) has no room for the tokens given: allocate a
    longer cache or finish the request."""


# ----------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class ModelConfig:
    """Family-independent shape and numerics of a decoder; what the forward and the engine read."""

    family: str  # "gpt2" or "llama"
    vocab_size: int
    hidden: int
    layers: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (== heads for multi-head attention, fewer for GQA)
    head_dim: int
    intermediate: int  # MLP inner width
    max_positions: int  # longest sequence the positions (learned table or rotary) allow
    norm_eps: float
    activation: str  # "gelu_tanh", "gelu" or "silu_glu"
    rope_theta: float | None  # rotary base; None for learned positions
    tie_embeddings: bool  # lm_head shares the token embedding
    eos_token_id: int | None  # the first of config.json's (the tokenizer holds every stop id)
    rope_scaling: RopeScaling | None = None  # how the rotary frequencies are scaled; None: plain
    model_type: str = ""  # config.json's model_type (llama, mistral, qwen2, gpt2)


ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """config.json's `rope_scaling` (or transformers 5's `rope_parameters`), normalised: how
    `rope_inv_freq` changes the rotary frequencies, as Hugging Face's rope types do.

    `dynamic` (NTK) changes them only past `original_max` positions, which this loader never lets
    a sequence reach (the model's positions are max_position_embeddings): its frequencies are
    plain."""

    kind: str  # one of ROPE_TYPES
    factor: float
    original_max: int  # positions the model was pretrained on
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by it


@dataclass(frozen=True)
class GPT2Config:
    """The config.json keys of a GPT-2 model that this loader reads (Hugging Face defaults)."""

    vocab_size: int = 50257
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    eos_token_id: int | None = 50256

    def normalise(self) -> ModelConfig:
        """The family-independent config; raises ModelLoadError for an unsupported activation."""
        if self.activation_function not in GPT2_GELU:
            raise ModelLoadError(
                f"GPT-2 activation_function {self.activation_function!r} is not "
                f"supported; use one of {sorted(GPT2_GELU)}"
            )
        gelu = "gelu_tanh" if GPT2_GELU[self.activation_function] == "tanh" else "gelu"
        return ModelConfig(
            "gpt2",
            self.vocab_size,
            self.n_embd,
            self.n_layer,
            self.n_head,
            self.n_head,
            self.n_embd // self.n_head,
            self.n_inner or 4 * self.n_embd,
            self.n_positions,
            self.layer_norm_epsilon,
            gelu,
            None,
            True,
            self.eos_token_id,
            None,
            "gpt2",
        )


@dataclass(frozen=True)
class LlamaConfig:
    """The config.json keys of a Llama, Mistral or Qwen2 model that this loader reads (Hugging Face
    defaults). Biases (Qwen2's q/k/v, Llama's `attention_bias`, `mlp_bias`) are read when the
    checkpoint has them."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None  # transformers 5: rope_theta and scaling
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    use_sliding_window: bool | None = None  # qwen2: the window is off unless this is true
    eos_token_id: int | list[int] | None = 2

    def normalise(self) -> ModelConfig:
        """The family-independent config; raises ModelLoadError for features the forward lacks."""
        if self.hidden_act != "silu":
            raise ModelLoadError(
                f"{self.model_type} hidden_act {self.hidden_act!r} is not supported (only silu)"
            )
        theta, scaling = self._rope()
        eos = self.eos_token_id[0] if isinstance(self.eos_token_id, list) else self.eos_token_id
        heads = self.num_attention_heads
        return ModelConfig(
            "llama",
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            heads,
            self.num_key_value_heads or heads,
            self.head_dim or self.hidden_size // heads,
            self.intermediate_size,
            self._positions(),
            self.rms_norm_eps,
            "silu_glu",
            theta,
            self.tie_word_embeddings,
            eos,
            scaling,
            self.model_type,
        )

    def _positions(self) -> int:
        """max_position_embeddings, or the sliding window when it is shorter: within the window,
        sliding-window attention is full causal attention, which is what the forward computes."""
        on = (
            bool(self.use_sliding_window)
            if self.model_type == "qwen2"
            else (self.use_sliding_window is not False)
        )
        window = self.sliding_window if on else None
        if window and window < self.max_position_embeddings:
            log.warning(
                "%s uses sliding-window attention (window %d): sequences are limited to %d tokens",
                self.model_type,
                window,
                window,
            )
            return window
        return self.max_position_embeddings

    def _rope(self) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) from rope_theta + rope_scaling, or from rope_parameters."""
        params = dict(self.rope_parameters or {})
        theta = float(params.get("rope_theta") or self.rope_theta or 10000.0)
        raw = self.rope_scaling or params
        kind = raw.get("rope_type") or raw.get("type") or "default"
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(
                "partial_rotary_factor is not supported (the whole head is rotated)"
            )
        if kind == "default":
            return theta, None
        if kind not in ROPE_TYPES:
            raise ModelLoadError(
                f"rope type {kind!r} is not supported; supported: {['default', *ROPE_TYPES]}"
            )
        factor = float(raw.get("factor") or 1.0)
        original = int(raw.get("original_max_position_embeddings") or self.max_position_embeddings)
        scaling = RopeScaling(kind, factor, original)
        if kind == "llama3":
            scaling = replace(
                scaling,
                low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
                high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            )
        if kind == "yarn":
            scaling = replace(
                scaling,
                beta_fast=float(raw.get("beta_fast") or 32),
                beta_slow=float(raw.get("beta_slow") or 1),
                truncate=bool(raw.get("truncate", True)),
                attention_factor=_yarn_attention_factor(raw, factor),
            )
        return theta, scaling


def _yarn_attention_factor(raw: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale as Hugging Face infers it when the config does not give it."""
    if raw.get("attention_factor") is not None:
        return float(raw["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if raw.get("mscale") and raw.get("mscale_all_dim"):
        return mscale(factor, raw["mscale"]) / mscale(factor, raw["mscale_all_dim"])
    return mscale(factor)


FAMILIES: dict[str, type[GPT2Config] | type[LlamaConfig]] = {
    "gpt2": GPT2Config,
    "llama": LlamaConfig,
    "mistral": LlamaConfig,
    "qwen2": LlamaConfig,
}


def family_of(raw: dict[str, Any]) -> str:
    """The model_type of a config.json, or guessed from its keys when it has none."""
    kind = raw.get("model_type") or ("gpt2" if "n_embd" in raw else "llama")
    if kind not in FAMILIES:
        raise ModelLoadError(f"model_type {kind!r} is not supported; supported: {sorted(FAMILIES)}")
    return str(kind)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Normalise a config.json dictionary; keys the family dataclass does not know are ignored."""
    kind = family_of(raw)
    cls = FAMILIES[kind]
    known = {f.name for f in fields(cls)}
    given = {k: v for k, v in raw.items() if k in known}
    if cls is LlamaConfig:
        given["model_type"] = kind
    return cls(**given).normalise()


# ----------------------------------------------------------------------------------------- weights
@dataclass
class Linear:
    """y = x @ weight.T + bias, torch's layout: weight [out, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class Norm:
    """LayerNorm (bias present) or RMSNorm (bias None) parameters."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class LayerWeights:
    """One decoder block."""

    attn_norm: Norm
    qkv: Linear  # rows: heads*head_dim queries, kv_heads*head_dim keys, values
    o: Linear
    mlp_norm: Norm
    up: Linear  # gpt2: c_fc; llama: gate and up rows in pairs (2*intermediate; `gate_up`)
    down: Linear


@dataclass
class Weights:
    """All parameters of a decoder in the normalised layout."""

    embed: torch.Tensor  # [vocab, hidden]
    positions: torch.Tensor | None  # [max_positions, hidden] learned (gpt2); None with rotary
    layers: list[LayerWeights]
    final_norm: Norm
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as `embed` when tied

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every parameter tensor once (the tied lm_head is not repeated)."""
        yield from (self.embed, self.lm_head) if self.lm_head is not self.embed else (self.embed,)
        yield from [self.positions] if self.positions is not None else []
        for part in [*self.layers, self.final_norm]:
            yield from (t for t in _leaves(part) if t is not None)


def _leaves(obj: Any) -> Iterator[torch.Tensor | None]:
    """Tensors inside nested weight dataclasses, in field order."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        yield from _leaves(value) if hasattr(value, "__dataclass_fields__") else [value]


# ----------------------------------------------------------------- HF names <-> normalised weights
class TensorSource(Protocol):
    """Tensors by Hugging Face name: `source(name)` (ModelLoadError when missing), and
    `name in source`."""

    def __call__(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: object) -> bool: ...


class DictSource:
    """A TensorSource over a dictionary."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str = "the checkpoint") -> None:
        self.tensors, self.where = tensors, where

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.where}: tensor {name!r} is missing")
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def _conv1d(get: TensorSource, name: str) -> Linear:
    """A GPT-2 Conv1D: its weight is stored [in, out], torch's Linear wants [out, in]."""
    return Linear(get(f"{name}.weight").t().contiguous(), get(f"{name}.bias"))


def _fused(get: TensorSource, *names: str) -> Linear:
    """Projections stacked by output rows, so one matmul computes them all; their biases too when
    the checkpoint has any (a projection without one gets zeros). Each part is freed once copied."""
    weights = [get(f"{name}.weight") for name in names]
    rows = [w.shape[0] for w in weights]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    del weights
    if not any(f"{name}.bias" in get for name in names):
        return Linear(weight)
    biases = [
        get(f"{n}.bias") if f"{n}.bias" in get else weight.new_zeros(r) for n, r in zip(names, rows)
    ]
    return Linear(weight, torch.cat(biases))


Names = tuple[str, ...]


def _paired(get: TensorSource, gate: str, up: str) -> Linear:
    """A gated MLP's gate and up projections as one, their rows in pairs (gate row j, then up
    row j; biases likewise), so that an output of the MLP is two neighbouring outputs of the
    projection: linear_silu_glu applies SwiGLU as it stores them. `gate_up` takes them apart."""
    stacked = _fused(get, gate, up)

    def pairs(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return Linear(pairs(stacked.weight), None if stacked.bias is None else pairs(stacked.bias))


def _layer_norm(get: TensorSource, name: str) -> Norm:
    return Norm(get(f"{name}.weight"), get(f"{name}.bias"))


def _gpt2_layer(get: TensorSource, i: int) -> LayerWeights:
    """GPT-2 block i from HF tensors."""
    p = f"transformer.h.{i}."
    return LayerWeights(
        _layer_norm(get, p + "ln_1"),
        _conv1d(get, p + "attn.c_attn"),
        _conv1d(get, p + "attn.c_proj"),
        _layer_norm(get, p + "ln_2"),
        _conv1d(get, p + "mlp.c_fc"),
        _conv1d(get, p + "mlp.c_proj"),
    )


def _llama_layer(get: TensorSource, i: int) -> LayerWeights:
    """Llama-layout block i from HF tensors; q/k/v and gate/up are concatenated for one matmul
    each."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    return LayerWeights(
        Norm(get(p + "input_layernorm.weight")),
        _fused(get, attn + "q_proj", attn + "k_proj", attn + "v_proj"),
        _fused(get, attn + "o_proj"),
        Norm(get(p + "post_attention_layernorm.weight")),
        _paired(get, mlp + "gate_proj", mlp + "up_proj"),
        _fused(get, mlp + "down_proj"),
    )


def weights_from_hf(config: ModelConfig, get: TensorSource, progress: str | None = None) -> Weights:
    """Build Weights from a TensorSource (ModelLoadError for a missing name), layer by layer; a
    progress bar (tqdm, on stderr) labelled `progress` unless it is None."""
    layer = _gpt2_layer if config.family == "gpt2" else _llama_layer
    bar = tqdm(
        total=config.layers, desc=progress, unit="layer", disable=progress is None, mininterval=0.5
    )
    layers = []
    with bar:
        for i in range(config.layers):
            layers.append(layer(get, i))
            bar.update()
    if config.family == "gpt2":
        embed = get("transformer.wte.weight")
        final = _layer_norm(get, "transformer.ln_f")
        return Weights(embed, get("transformer.wpe.weight"), layers, final, embed)
    embed = get("model.embed_tokens.weight")
    head = embed if config.tie_embeddings else get("lm_head.weight")
    return Weights(embed, None, layers, Norm(get("model.norm.weight")), head)


def _gpt2_to_hf(w: Weights) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": w.embed, "transformer.ln_f.weight": w.final_norm.weight}
    out.update({"transformer.wpe.weight": w.positions} if w.positions is not None else {})
    if w.final_norm.bias is not None:
        out["transformer.ln_f.bias"] = w.final_norm.bias
    for i, lw in enumerate(w.layers):
        parts: dict[str, Linear | Norm] = {
            "ln_1": lw.attn_norm,
            "attn.c_attn": lw.qkv,
            "attn.c_proj": lw.o,
            "ln_2": lw.mlp_norm,
            "mlp.c_fc": lw.up,
            "mlp.c_proj": lw.down,
        }
        for name, part in parts.items():
            weight = part.weight.t() if isinstance(part, Linear) else part.weight
            out[f"transformer.h.{i}.{name}.weight"] = weight.contiguous()
            if part.bias is not None:
                out[f"transformer.h.{i}.{name}.bias"] = part.bias
    return out


def _llama_to_hf(w: Weights, config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm.weight}
    if not config.tie_embeddings:
        out["lm_head.weight"] = w.lm_head
    q, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        splits: dict[str, tuple[Linear, Callable[[torch.Tensor], Sequence[torch.Tensor]], Names]]
        splits = {
            "self_attn.": (lw.qkv, lambda t: t.split([q, kv, kv]), ("q_proj", "k_proj", "v_proj")),
            "self_attn.o": (lw.o, lambda t: (t,), ("_proj",)),
            "mlp.": (lw.up, lambda t: gate_up(t, 0), ("gate_proj", "up_proj")),
            "mlp.down": (lw.down, lambda t: (t,), ("_proj",)),
        }
        for prefix, (linear, parts_of, names) in splits.items():
            for part in ("weight", "bias"):
                tensor = getattr(linear, part)
                if tensor is not None:
                    out.update(
                        {
                            f"{p}{prefix}{n}.{part}": t.contiguous()
                            for n, t in zip(names, parts_of(tensor))
                        }
                    )
        out.update(
            {
                p + "input_layernorm.weight": lw.attn_norm.weight,
                p + "post_attention_layernorm.weight": lw.mlp_norm.weight,
            }
        )
    return out


def weights_to_hf(config: ModelConfig, weights: Weights) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of `weights` (the inverse of weights_from_hf; a tied lm_head
    omitted)."""
    return _gpt2_to_hf(weights) if config.family == "gpt2" else _llama_to_hf(weights, config)


# ----------------------------------------------------------------------------------- files on disk
def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors file (nor {INDEX_FILE}); save the "
            "model with safetensors (save_pretrained(..., "
            "safe_serialization=True))"
        )
    return files


# safetensors' dtype names of the floating dtypes a model may be served in
STORED_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class Checkpoint:
    """The tensors of a model directory's safetensors files (a TensorSource), each read from its
    shard only when asked for and cast to `dtype` at once: building the weights layer by layer
    then holds about one copy of them. Use as a context manager (it keeps the shards open)."""

    def __init__(self, path: Path, device: str = "cpu") -> None:
        self.path = path
        self.dtype: torch.dtype | None = None  # None: each tensor as stored
        self.files = _shard_files(path)
        self._stack = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}
        # Hub GPT-2 checkpoints (e.g. "gpt2") were saved from GPT2Model: their names lack
        # "transformer.".
        bare = ("wte", "wpe", "h", "ln_f")
        for file in self.files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device=device))
            for key in handle.keys():
                name = "transformer." + key if key.split(".")[0] in bare else key
                self._where[name] = (handle, key)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype tensor `name` is stored in (float32 for one that is not fp32/fp16/bf16)."""
        handle, key = self._where[name] if name in self._where else (None, "")
        if handle is None:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is missing from the safetensors files"
            )
        return STORED_DTYPES.get(handle.get_slice(key).get_dtype(), torch.float32)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is missing from the safetensors files"
            )
        handle, key = self._where[name]
        tensor = handle.get_tensor(key)
        return tensor.to(self.dtype) if self.dtype is not None else tensor

    def __contains__(self, name: object) -> bool:
        return name in self._where


def read_tensors(path: Path, dtype: torch.dtype | None, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, cast to `dtype` (None keeps each
    file's)."""
    with Checkpoint(path, device) as checkpoint:
        checkpoint.dtype = dtype
        return {name: checkpoint(name) for name in checkpoint._where}


def save_pretrained(
    path: str | Path, raw_config: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 1
) -> Path:
    """Write config.json and the tensors as Hugging Face safetensors (an index file when
    shards > 1)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw_config, indent=2))
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    files = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    for file, group in zip(files, groups):
        save_file(
            {k: tensors[k].contiguous() for k in group}, str(path / file), metadata={"format": "pt"}
        )
    if shards > 1:
        weight_map = {k: file for file, group in zip(files, groups) for k in group}
        index = {"metadata": {}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return path


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """Accept a torch dtype or its name ("bfloat16", "float16", "float32")."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> Model:
    """Load a model (GPT-2, Llama, Mistral, Qwen2) from a Hugging Face-format directory.

    `dtype` None keeps the checkpoint's (that of its token embedding; every tensor is cast to it).
    Tensors are read and cast one at a time and fused layer by layer, so host memory peaks at about
    one copy of the weights. Raises ModelLoadError for a missing config.json or tensor or an
    unsupported feature. Progress is logged to the `gpuos.llm` logger, and shown as a tqdm bar on
    stderr when `progress`.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"{path} has no config.json; point the model path at a Hugging Face model directory"
        )
    config = parse_config(json.loads((path / "config.json").read_text()))
    with Checkpoint(path, device) as checkpoint:
        embed = "transformer.wte.weight" if config.family == "gpt2" else "model.embed_tokens.weight"
        checkpoint.dtype = _dtype(dtype) or checkpoint.stored_dtype(embed)
        size = sum(f.stat().st_size for f in checkpoint.files) / 2**20
        log.info(
            "loading %s: %d safetensors file(s), %.1f MiB, as %s",
            path.name,
            len(checkpoint.files),
            size,
            checkpoint.dtype,
        )
        label = f"loading {path.name} ({len(checkpoint.files)} shards)" if progress else None
        weights = weights_from_hf(config, checkpoint, label)
    params = sum(t.numel() for t in weights.tensors())
    log.info(
        "loaded %s: %s (%s), %d layers, hidden %d, %.1fM parameters, %s",
        path.name,
        config.model_type or config.family,
        config.family,
        config.layers,
        config.hidden,
        params / 1e6,
        weights.embed.dtype,
    )
    return Model(config, weights)


# ------------------------------------------------------------------------------------- tiny models
TINY: dict[str, dict[str, Any]] = {
    "gpt2": {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    },
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    },
}


# The tiny models' tokenizer is bytes (no tokenizer.json); their chat template writes plain text.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TINY_TOKENIZER: dict[str, Any] = {"chat_template": TINY_CHAT_TEMPLATE, "model_max_length": 128}


def _random_norm(hidden: int, gen: torch.Generator, biased: bool) -> Norm:
    """Norm weights near 1 (not exactly, so a wrongly mapped norm shows in the logits)."""
    bias = 0.1 * torch.randn(hidden, generator=gen) if biased else None
    return Norm(1 + 0.1 * torch.randn(hidden, generator=gen), bias)


def _random_layer(config: ModelConfig, gen: torch.Generator, biased: bool) -> LayerWeights:
    """A block with weights scaled 1/sqrt(fan_in) so activations stay O(1) and every weight
    matters."""

    def lin(out: int, inp: int) -> Linear:
        bias = torch.randn(out, generator=gen) * 0.1 if biased else None
        return Linear(torch.randn(out, inp, generator=gen) / math.sqrt(inp), bias)

    qkv = (config.heads + 2 * config.kv_heads) * config.head_dim
    up = config.intermediate * (2 if config.activation == "silu_glu" else 1)
    attn_norm, mlp_norm = (_random_norm(config.hidden, gen, biased) for _ in range(2))
    attn_out = lin(config.hidden, config.heads * config.head_dim)
    return LayerWeights(
        attn_norm,
        lin(qkv, config.hidden),
        attn_out,
        mlp_norm,
        lin(up, config.hidden),
        lin(config.hidden, config.intermediate),
    )


def random_weights(config: ModelConfig, seed: int) -> Weights:
    """Random fp32 weights of `config`'s shapes, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    biased = config.family == "gpt2"
    layers = [_random_layer(config, gen, biased) for _ in range(config.layers)]
    # 1/sqrt(hidden): with GPT-2's tied head, logits are then O(1), so sampling is not one-hot.
    embed = torch.randn(config.vocab_size, config.hidden, generator=gen) / math.sqrt(config.hidden)
    positions = (
        torch.randn(config.max_positions, config.hidden, generator=gen) * 0.5 if biased else None
    )
    final = _random_norm(config.hidden, gen, biased)
    shape = (config.vocab_size, config.hidden)
    head = (
        embed
        if config.tie_embeddings
        else torch.randn(shape, generator=gen) / math.sqrt(config.hidden)
    )
    return Weights(embed, positions, layers, final, head)


def create_tiny_model(path: str | Path, family: str, seed: int = 0, shards: int = 1) -> Path:
    """Save a small random `family` model ("gpt2" or "llama", vocab 256 for the byte tokenizer) in
    Hugging Face format at `path` and return the path; load it with load_model like any other."""
    if family not in TINY:
        raise ModelLoadError(f"family {family!r} is not supported; use one of {sorted(TINY)}")
    config = parse_config(TINY[family])
    tensors = weights_to_hf(config, random_weights(config, seed))
    log.info("creating tiny %s model (seed %d) at %s", family, seed, path)
    path = save_pretrained(path, TINY[family], tensors, shards)
    (path / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER, indent=2))
    return path


# ---------------------------------------------------------------------------------------- KV cache
@dataclass
class KVPool:
    """Keys and values of `slots` sequences: [layers, slots, max_len, kv_heads, head_dim] each, so
    that one token's keys (all heads) are one contiguous row (a KV-cache append is a row write)."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        shape = cls.shape(config, slots, max_len)
        return cls(*(torch.empty(shape, dtype=dtype, device=device) for _ in range(2)))

    @staticmethod
    def shape(config: ModelConfig, slots: int, max_len: int) -> tuple[int, ...]:
        """Shape of the keys (and of the values) of a pool of `slots` slots of `max_len`."""
        return (config.layers, slots, max_len, config.kv_heads, config.head_dim)

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]


@dataclass
class KVCache:
    """One request's keys and values: a pool of one slot, of which `length` tokens (positions
    0..length-1) are valid. A forward at `start` <= length overwrites from `start` on, so a caller
    may roll back (e.g. drop rejected tokens) by passing an earlier start."""

    pool: KVPool
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.pool.max_len

    def check_room(self, start: int, count: int) -> None:
        """Raise unless positions start..start+count-1 fit and `start` leaves no gap."""
        if start > self.length:
            raise ValueError(
                f"start {start} is past the cache's {self.length} valid tokens; "
                "positions must be contiguous"
            )
        if start + count > self.max_len:
            raise KVCacheFullError(
                f"KV cache holds {self.max_len} tokens; writing {count} at "
                f"position {start} needs {start + count}: allocate a longer "
                "cache or finish the request"
            )


# ----------------------------------------------------------------------------- reference functions
def layer_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, computed in fp32 and returned in x's dtype."""
    bias = norm.bias.float() if norm.bias is not None else None
    return F.layer_norm(x.float(), x.shape[-1:], norm.weight.float(), bias, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face Llama: normalise in fp32, cast back, then scale by the weight."""
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def normalize(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    """LayerNorm when the norm has a bias (GPT-2), else RMSNorm (Llama)."""
    return layer_norm(x, norm, eps) if norm.bias is not None else rms_norm(x, norm, eps)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [head_dim / 2] (fp32) and the factor cos and sin are scaled
    by, as Hugging Face computes them for each rope type (modeling_rope_utils)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None or scaling.kind == "dynamic":  # dynamic: plain within original_max positions
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.kind == "linear":
        return inv_freq / factor, 1.0
    if scaling.kind == "llama3":
        low_wavelen = scaling.original_max / scaling.low_freq_factor
        high_wavelen = scaling.original_max / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (scaling.original_max / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0

    # yarn: interpolate the low frequencies, extrapolate the high ones, ramp between
    def correction(rotations: float) -> float:
        return (
            head_dim
            * math.log(scaling.original_max / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction(scaling.beta_fast), correction(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    ).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, scaling.attention_factor


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] (fp32) of rotary embedding for `positions` [N], HF's half-split
    layout, with `scaling`'s frequencies (and YaRN's attention factor folded into both)."""
    inv_freq, attention = rope_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    if attention == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention, emb.sin() * attention


def rotary_tables(model: Model, max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin [max_len, head_dim / 2] in the model's dtype, on its device, for the device
    step's rotary (None for a model without rotary embeddings)."""
    c, w = model.config, model.weights.embed
    if c.rope_theta is None:
        return None
    positions = torch.arange(max_len, device=w.device)
    cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)
    half = c.head_dim // 2
    return cos[:, :half].to(w.dtype).contiguous(), sin[:, :half].to(w.dtype).contiguous()


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] by its row's position (rotate-half convention of HF Llama)."""
    cos, sin = (
        t[:, None, :].to(x.dtype) for t in rotary_cos_sin(positions, x.shape[-1], theta, scaling)
    )
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of one request: q [T, heads, d] at positions start..start+T-1 over k, v
    [kv_heads, start+T, d]; query head h reads kv head h // (heads // kv_heads). Softmax in fp32.
    Returns [T, heads, d] in q's dtype."""
    group = q.shape[1] // k.shape[0]
    k, v = (t.float().repeat_interleave(group, dim=0) for t in (k, v))
    scores = torch.einsum("thd,hsd->hts", q.float(), k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(start, start + q.shape[0], device=q.device)[:, None]
    future = torch.arange(k.shape[1], device=q.device)[None, :] > query_pos
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v).to(q.dtype)


# ------------------------------------------------------------------------------------------- model
@dataclass
class Model:
    """A loaded decoder: its config and weights (its forward: serving/llm/forward.py)."""

    config: ModelConfig
    weights: Weights

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache in the model's dtype and device (default length: max_positions)."""
        w = self.weights.embed
        length = max_len or self.config.max_positions
        pool = KVPool.allocate(self.config, 1, length, w.dtype, w.device)
        return KVCache(pool)
