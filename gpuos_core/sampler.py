"""The device sampling rule in torch: what the CPU backend runs for `sample_tokens`, and what the
CUDA kernel (cuda/ops/sample.cuh, whose header comment states the rule) agrees with, drawing the
same Philox4x32-10 numbers.

Selection compares logits exactly, as the kernel does; masses are summed here in float64 and the
noise uses torch.log, so a token can differ from the kernel's only when a top-p mass or two noisy
keys tie within float rounding.
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers (Random123, curand)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule increments
WINDOW = 32.0  # tokens more than WINDOW * temperature below the max logit are never drawn


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for a constant a < 2^32 and int64 b in [0, 2^32). b is
    split in 16-bit halves so that no int64 product overflows."""
    low, high = a * (b & 0xFFFF), a * (b >> 16)  # each < 2^48
    t = low + ((high & 0xFFFF) << 16)  # a * b = t + (high >> 16) * 2^32
    return ((t >> 32) + (high >> 16)) & MASK32, t & MASK32


def philox4x32(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 (Salmon et al., SC'11) of int64 counters [..., 4] under keys [..., 2] (words
    in [0, 2^32), broadcasting); returns the four output words [..., 4] as int64."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for _ in range(10):
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def rng_rows(seeds: list[int], steps: list[int]) -> torch.Tensor:
    """The int32 [R, 3] rng input of sample_tokens: (seed low word, seed high word, step) per
    row, as int32 bit patterns; seeds in [0, 2^64), steps in [0, 2^32)."""
    return torch.from_numpy(rng_at(rng_keys(seeds), steps))


def rng_keys(seeds: list[int]) -> np.ndarray:
    """The seeds' words of rng rows, uint32 [R, 3] (steps 0): what a batch of requests keeps
    while only its steps change (rng_at)."""
    keys = np.array(seeds, dtype=np.uint64)
    words = np.zeros((len(seeds), 3), dtype=np.uint32)
    words[:, 0] = keys & np.uint64(MASK32)
    words[:, 1] = keys >> np.uint64(32)
    return words


def rng_at(keys: np.ndarray, steps: list[int]) -> np.ndarray:
    """rng rows (int32 bit patterns, a new array) of `keys` (rng_keys) at `steps`."""
    if len(keys) != len(steps):
        raise ValueError(f"{len(keys)} seeds for {len(steps)} steps")
    words = keys.copy()
    words[:, 2] = np.array(steps, dtype=np.int64) & MASK32
    return words.view(np.int32)  # same bits


def _uniform_words(cols: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
    """Philox word of token j = cols[i] for the row whose rng row is rng[i]: counter (j // 4, step,
    0, 0) under key (seed low, seed high), word j % 4."""
    words = rng.long() & MASK32
    zero = torch.zeros_like(cols)
    counter = torch.stack((cols >> 2, words[:, 2], zero, zero), dim=-1)
    out = philox4x32(counter, words[:, :2])
    return out.gather(-1, (cols & 3)[:, None])[:, 0]


def gumbel_noise(words: torch.Tensor) -> torch.Tensor:
    """g = -log(-log(u)), u = ((x >> 9) + 0.5) * 2^-23 in (0, 1), in float32 (u is exact)."""
    u = ((words >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def _kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """values sorted in descending order per row [R, V]: the k-th largest (k >= 1, clamped to V)."""
    return values.gather(-1, (k - 1).clamp(0, values.shape[-1] - 1)[:, None])[:, 0]


def _top_k(z: torch.Tensor, kept: torch.Tensor, k: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """kept narrowed, in rows where `use`, to tokens at or above the k-th largest kept logit (all
    of kept when it holds at most k tokens)."""
    if not use.any():
        return kept
    ranked = z.masked_fill(~kept, -torch.inf).sort(dim=-1, descending=True).values
    use = use & (k < kept.sum(dim=-1))
    return kept & (~use[:, None] | (z >= _kth_largest(ranked, k)[:, None]))


def _top_p(
    z: torch.Tensor,
    kept: torch.Tensor,
    m: torch.Tensor,
    temp: torch.Tensor,
    top_p: torch.Tensor,
    use: torch.Tensor,
) -> torch.Tensor:
    """kept narrowed, in rows where `use`, to logits >= v*, the largest kept logit whose kept
    tokens at or above it hold at least top_p of kept's mass exp((z - m) / T) (float64)."""
    if not use.any():
        return kept
    ranked = z.masked_fill(~kept, -torch.inf).sort(dim=-1, descending=True).values
    mass = torch.exp((ranked.double() - m.double()[:, None]) / temp.double()[:, None])
    cum = mass.cumsum(dim=-1)  # masked tokens weigh exp(-inf) = 0
    crossing = (cum < top_p.double()[:, None] * cum[:, -1:]).sum(dim=-1)
    return kept & (~use[:, None] | (z >= _kth_largest(ranked, crossing + 1)[:, None]))


def sample_rows(logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
    """One int32 token id per row of logits [R, V] (any float dtype; -inf masks a token, never
    NaN or +inf) under params float32 [R, 3] = (temperature, top_p, top_k) and rng int32 [R, 3]
    (rng_rows); the rule of cuda/ops/sample.cuh, steps 1-5."""
    z = logits.float()
    temp, top_p, top_k = params.float().unbind(-1)
    m, arg = z.max(dim=-1)  # the first index of the max, like torch.argmax
    k = top_k.nan_to_num(0.0).clamp(-(2.0**31), 2.0**31 - 1).long()
    sampled = (temp > 0) & (k != 1) & m.isfinite()
    if not sampled.any():
        return arg.int()
    kept = z >= (m - WINDOW * temp)[:, None]
    kept = _top_k(z, kept, k, sampled & (k > 1))
    kept = _top_p(z, kept, m, temp, top_p, sampled & (top_p < 1))
    rows, cols = (kept & sampled[:, None]).nonzero(as_tuple=True)
    g = gumbel_noise(_uniform_words(cols, rng[rows]))
    keys = torch.full_like(z, -torch.inf)
    keys[rows, cols] = (z[rows, cols] - m[rows]) + temp[rows] * g
    return torch.where(sampled, keys.argmax(dim=-1), arg).int()
