"""The model's forward, written once over a small micro-op interface.

`forward(model, ops)` reads as the model: embed and norm; per layer q, k, v (the fused projection,
q and k rotated) → attention (which stores the rows' keys and values) → output projection +
residual → norm → MLP (its down projection + residual → the next norm); then the final norm and
the LM head. It knows nothing of where the rows run or how they are laid out: `ops` owns the
step's rows (token ids, positions, KV slots) and the KV pool. Two implementations of `MicroOps`:
- `TorchOps` (here): eager torch, the reference: `forward_tokens`, the engine's tests and its
  `micro_ops: torch` baseline;
- `ProgramOps` (serving/llm/device_step.py): records the same calls into one device program.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from gpuos_core.families import GATED, gate_up
from serving.llm.model import (
    KVCache,
    KVCacheFullError,
    KVPool,
    Linear,
    Model,
    ModelConfig,
    Norm,
    apply_rotary,
    attend,
    normalize,
)


class MicroOps(Protocol):
    """What the forward asks of an implementation. Tensors are rows [N, ...] of the step."""

    def embed(
        self, table: torch.Tensor, positions: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, its norm): the rows' token embeddings [N, hidden], plus their learned position
        embeddings, and the first layer's norm of them."""

    def residual(
        self, x: torch.Tensor, h: torch.Tensor, linear: Linear, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + linear(h), its norm): a residual branch's last projection added to the residual
        stream, and the norm that reads the sum; x may be updated in place."""

    def qkv(
        self, h: torch.Tensor, linear: Linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's q [N, heads, d], k and v [N, kv_heads, d] of normed rows h: the fused
        projection (`split_heads`), q and k rotated by each row's position where the model has
        rotary embeddings."""

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store the rows' k, v [N, kv_heads, d] at their slots and positions, then causal
        attention of each row q [N, heads, d] over its own request's keys: [N, heads, d]."""

    def activated(self, x: torch.Tensor, linear: Linear, kind: str) -> torch.Tensor:
        """An MLP's up projection and its activation: GELU (`gelu`, `gelu_tanh`) of linear(x), or
        SwiGLU (`silu_glu`: silu(gate) * up, its outputs in pairs: families.gate_up)."""

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, vocab] of the rows whose logits the step wants (normed rows h)."""


def forward(model: Model, ops: MicroOps) -> torch.Tensor:
    """The logits `ops.logits` picks, the keys and values of every row stored on the way."""
    c, w = model.config, model.weights
    x, h = ops.embed(w.embed, w.positions, w.layers[0].attn_norm)
    for i, layer in enumerate(w.layers):
        q, k, v = ops.qkv(h, layer.qkv)
        a = ops.attention(i, q, k, v)
        x, h = ops.residual(x, a.flatten(1), layer.o, layer.mlp_norm)
        g = ops.activated(h, layer.up, c.activation)
        # the residual add fuses with the next norm: the next layer's, or the final one
        x, h = ops.residual(
            x, g, layer.down, w.layers[i + 1].attn_norm if i + 1 < c.layers else w.final_norm
        )
    return ops.logits(h, w.lm_head)


def split_heads(
    c: ModelConfig, qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [N, heads, d], k, v [N, kv_heads, d] of the fused projection's rows."""
    sizes = [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim]
    q, k, v = (t.view(qkv.shape[0], -1, c.head_dim) for t in qkv.split(sizes, -1))
    return q, k, v


class Span(NamedTuple):
    """One request's rows in a step: `tokens` at positions start, start + 1, ... of KV slot
    `slot`. The step computes the logits of its last row. A tuple: the engine makes one a
    request every step, and a frozen dataclass takes twice as long to make."""

    slot: int
    start: int
    tokens: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class TorchOps:
    """Eager torch over spans' rows stacked in order (the reference implementation); logits of
    each span's last row, or of every row when `every_row`."""

    def __init__(
        self, config: ModelConfig, pool: KVPool, spans: Sequence[Span], every_row: bool = False
    ) -> None:
        device = pool.keys.device
        self.config, self.pool, self.spans = config, pool, tuple(spans)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.tokens = as_long([t for s in spans for t in s.tokens])
        self.positions = as_long([p for s in spans for p in range(s.start, s.end)])
        self.slots = as_long([s.slot for s in spans for _ in s.tokens])
        firsts = [0, *itertools.accumulate(len(s.tokens) for s in spans)][:-1]
        self.firsts = tuple(firsts)
        last = [f + len(s.tokens) - 1 for f, s in zip(firsts, spans)]
        self.picked = torch.arange(len(self.tokens), device=device) if every_row else as_long(last)

    def embed(
        self, table: torch.Tensor, positions: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = table[self.tokens]
        if positions is not None:
            x = x + positions[self.positions]
        return x, self.norm(x, norm)

    def norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        """LayerNorm (the norm has a bias) or RMSNorm of each row."""
        return normalize(x, norm, self.config.norm_eps)

    def residual(
        self, x: torch.Tensor, h: torch.Tensor, linear: Linear, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + linear(h)
        return s, self.norm(s, norm)

    def qkv(
        self, h: torch.Tensor, linear: Linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(self.config, linear(h))
        if self.config.rope_theta is None:
            return q, k, v
        return self.rotary(q), self.rotary(k), v

    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim] rotated by each row's position (a model with rotary
        embeddings)."""
        theta = self.config.rope_theta
        assert theta is not None, "rotary() of a model without rotary embeddings"
        return apply_rotary(x, self.positions, theta, self.config.rope_scaling)

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [slots, len, kv, d]
        keys[self.slots, self.positions] = k
        values[self.slots, self.positions] = v
        out = torch.empty_like(q)
        for first, s in zip(self.firsts, self.spans):
            rows = slice(first, first + len(s.tokens))
            out[rows] = attend(
                q[rows],
                keys[s.slot, : s.end].transpose(0, 1),
                values[s.slot, : s.end].transpose(0, 1),
                s.start,
            )
        return out

    def activated(self, x: torch.Tensor, linear: Linear, kind: str) -> torch.Tensor:
        h = linear(x)
        if kind == GATED:
            gate, up = gate_up(h)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh" if kind == "gelu_tanh" else "none")

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return F.linear(h[self.picked], head).float()


def forward_tokens(
    model: Model, tokens: torch.Tensor, cache: KVCache | None = None, start: int = 0
) -> torch.Tensor:
    """Logits [T, vocab] (fp32) of one request's `tokens` [T] at positions start..start+T-1.

    With a cache, earlier positions come from it and these tokens' keys/values are stored in it
    (its `length` becomes start+T). Without one, the tokens are the whole sequence: start must
    be 0. Raises KVCacheFullError when the cache or the model's positions have no room.
    """
    if cache is None and start != 0:
        raise ValueError("without a KV cache the tokens are the whole sequence: start must be 0")
    count, limit = tokens.shape[0], model.config.max_positions
    if start + count > limit:
        raise KVCacheFullError(
            f"position {start + count - 1} is past the model's {limit} "
            "positions; shorten the prompt or max_tokens"
        )
    cache = cache or model.new_cache(count)
    cache.check_room(start, count)
    span = Span(0, start, tuple(tokens.tolist()))
    logits = forward(model, TorchOps(model.config, cache.pool, [span], every_row=True))
    cache.length = start + count
    return logits
