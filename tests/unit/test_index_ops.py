"""Operators that read per-run sizes from int32 device tensors (issue 11): attention decode over
per-row KV lengths, rotary at per-row positions, and scatter_rows into a KV cache. Each backend
against references built independently in float64 (slicing, gathering, a loop over rows), plus
the validation messages, and a decode program rerun after its index tensors changed."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from test_catalogue import DTYPES, TOLERANCE, rel_error

from gpuos_core import OpCall, Runtime
from gpuos_core.catalogue import CATALOGUE, run_reference
from gpuos_core.config import CudaConfig
from gpuos_core.errors import TensorSpecError
from gpuos_core.families import (
    DEFAULT_SMS,
    ROTARY_PASS_ROWS,
    SCATTER_RECORD_ROWS,
    SCATTER_SPREAD,
    family,
)
from gpuos_core.paths import CUDA_DIR

I32 = torch.int32


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def randn(rt: Runtime, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal samples drawn on the CPU (the same numbers on every backend), on the runtime's
    device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=rt.device)


def ints(rt: Runtime, values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=rt.device)


def run(rt: Runtime, call: OpCall) -> torch.Tensor:
    return rt.submit([rt.prepare(call)]).wait(30).result(0)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = rel_error(out.cpu(), ref.cpu())
    assert err < TOLERANCE[out.dtype], f"relative error {err:.2e}"


# -- attention decode over per-row lengths ----------------------------------------------------


def sliced_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Per request b, SDPA of its queries [Hkv, G, D] over keys [0, min(lengths[b], L)) of its
    cache [Hkv, L, D]; zeros for a request with no key. float64 on the CPU."""
    q, k, v = (t.cpu().double() for t in (q, k, v))
    out = torch.zeros_like(q)
    for b, n in enumerate(lengths.flatten().tolist()):
        n = min(n, k.shape[-2])
        if n > 0:
            out[b] = F.scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n])
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_attention_ragged_lengths_match_sliced_reference(
    rt: Runtime, dtype: torch.dtype, d: int
) -> None:
    kv_heads, group, capacity = 1, 2, 4096
    lengths = [1, 2, 31, 33, 257, 1000, 4095, 4096]
    batch = len(lengths)
    k, v = (randn(rt, (batch, kv_heads, capacity, d), dtype, seed) for seed in (1, 2))
    for b, n in enumerate(lengths):  # never read: past each request's length
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    q = randn(rt, (batch, kv_heads, group, d), dtype, 3)
    n = ints(rt, lengths).view(batch, 1, 1)  # one length per request, broadcast over heads
    out = run(rt, OpCall("attention_decode", (q, k[:, :, None], v[:, :, None], n)))
    assert_close(out, sliced_attention(q, k, v, n))


def test_attention_lengths_zero_negative_and_past_the_cache(rt: Runtime) -> None:
    batch, heads, capacity, d = 5, 4, 40, 64
    lengths = ints(rt, [0, -3, 17, 40, 1000]).view(batch, 1)
    q = randn(rt, (batch, heads, d), torch.float32, 4)
    k, v = (randn(rt, (batch, heads, capacity, d), torch.float32, seed) for seed in (5, 6))
    out = torch.full_like(q, float("nan"))
    run(rt, OpCall("attention_decode", (q, k, v, lengths), out=out))
    assert (out[:2] == 0).all()  # no key: zeros, not NaN
    assert_close(out, sliced_attention(q[:, :, None], k, v, lengths)[:, :, 0])


def test_attention_lengths_from_a_strided_view_on_a_single_row(rt: Runtime) -> None:
    every = ints(rt, [9, 100, 3, 100])
    q, k, v = (
        randn(rt, shape, torch.float16, seed)
        for seed, shape in ((7, (2, 32)), (8, (2, 12, 32)), (9, (2, 12, 32)))
    )
    out = run(rt, OpCall("attention_decode", (q, k, v, every[::2])))  # lengths 9 and 3
    assert_close(
        out, sliced_attention(q[:, None, None], k[:, None], v[:, None], every[::2].cpu())[:, 0, 0]
    )
    row = run(rt, OpCall("attention_decode", (q[0], k[0], v[0], every[2])))  # 0-dim length
    assert_close(
        row,
        sliced_attention(q[:1, None, None], k[:1, None], v[:1, None], every[2:3].cpu())[0, 0, 0],
    )


# -- rotary at per-row positions --------------------------------------------------------------


def gathered_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Hugging Face's rotate-half rotary with the tables' rows gathered at the clamped positions
    (cos/sin [P, D/2] repeated to [P, D]). float64 on the CPU."""
    x, cos, sin = (t.cpu().double() for t in (x, cos, sin))
    at = positions.cpu().long().clamp(0, cos.shape[0] - 1)
    c, s = torch.cat((cos, cos), -1)[at], torch.cat((sin, sin), -1)[at]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [2, 64, 128, 256])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rotary_positions_per_row_match_gathered_tables(
    rt: Runtime, dtype: torch.dtype, d: int, tokens: int
) -> None:
    heads, table = 3, 50
    angle = torch.arange(table)[:, None] * 0.9 ** torch.arange(d // 2)
    cos, sin = (f(angle).to(dtype=dtype, device=rt.device) for f in (torch.cos, torch.sin))
    x = randn(rt, (tokens, heads, d), dtype, tokens + d)
    picks = [-4, 0, 1, 49, 50, 1000, 17]  # out of range: clamped into [0, 49]
    positions = ints(rt, [picks[t % len(picks)] for t in range(tokens)]).view(tokens, 1)
    out = run(rt, OpCall("rotary", (x, cos, sin, positions)))
    assert_close(out, gathered_rotary(x, cos, sin, positions))


def test_rotary_positions_in_place_over_strided_rows_and_tables(rt: Runtime) -> None:
    tokens, heads, d, table = 6, 4, 16, 20
    angle = randn(rt, (table, d), torch.float32, 10)
    cos, sin = angle.cos()[:, ::2], angle.sin()[:, ::2]  # non-contiguous tables [20, 8]
    qkv = randn(rt, (tokens, 3 * heads, d), torch.float32, 11)
    k = qkv[:, heads : 2 * heads]  # a strided view, rotated in place
    positions = ints(rt, [[p] * heads for p in (3, 0, 19, 7, 7, 2)])  # already expanded
    expect = gathered_rotary(k, cos, sin, positions)
    run(rt, OpCall("rotary", (k, cos, sin, positions), out=k))
    assert_close(k, expect)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("parts", [1, 2, 3, 6])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_rotary_parts_sum_the_splits_and_rotate_the_heads_before_rotated(
    rt: Runtime, dtype: torch.dtype, parts: int, tokens: int
) -> None:
    """A fused q, k, v projection's partial sums (Llama-3.2-1B's: 32 q heads, then 8 k and 8 v
    heads): their sum in fp32, q and k rotated at each row's position, v passed on, in out's
    dtype. On a GPU, 64 tokens' 3,072 rows go in records of 46-47 (on half the SMs), each in two
    passes of the packed form (32 rows at a time, 4 a warp); 5 tokens' 240 in 7 records of 34-35
    (a second pass of 2-3 rows); one token's 48 a warp a row."""
    heads, rotated, d, table = 48, 40, 64, 50
    angle = torch.arange(table)[:, None] * 0.9 ** torch.arange(d // 2)
    cos, sin = (f(angle).to(device=rt.device) for f in (torch.cos, torch.sin))
    split = randn(rt, (parts, tokens, heads, d), torch.float32, 100 * parts + tokens)
    positions = ints(rt, [(7 * t) % (table + 3) for t in range(tokens)]).view(tokens, 1)
    out = torch.empty((tokens, heads, d), dtype=dtype, device=rt.device)
    call = OpCall("rotary_parts", (split, cos, sin, positions), out=out, scalars={"rotated": 40})
    run(rt, call)
    summed = split.cpu().double().sum(0)
    expect = summed.clone()
    expect[:, :rotated] = gathered_rotary(summed[:, :rotated], cos, sin, positions)
    assert_close(out, expect)


def test_rotary_parts_records_are_whole_packed_passes_on_half_the_sms() -> None:
    """Llama-3.2-1B's 48 heads of 64 a token: from two passes' rows on, records of at least a
    packed pass (8 tokens: 12 records of 32 rows, where cut by elements they were 48 of 8 that
    held blocks beside the QKV projection's), at most half the SMs (64 tokens: 66 records); one
    token's 48 rows as the elements say. The pass is rotary.cuh's: GPUOS_ROTARY_PACKED rows a
    warp of the worker block."""

    def cut(tokens: int) -> list[int]:
        with Runtime("cpu") as runtime:
            split = torch.zeros(2, tokens, 48, 64)
            table = torch.zeros(50, 32)
            at = torch.zeros(tokens, 1, dtype=I32)
            task = runtime.prepare(OpCall("rotary_parts", (split, table, table, at)))
        return [e - b for b, e in family("rotary_parts").ranges(task, 16384)]

    packed = re.search(
        r"#define GPUOS_ROTARY_PACKED (\d+)", (CUDA_DIR / "ops" / "rotary.cuh").read_text()
    )
    assert packed is not None
    assert ROTARY_PASS_ROWS == int(packed.group(1)) * CudaConfig().block_threads // 32
    assert cut(8) == [ROTARY_PASS_ROWS] * 12
    assert min(cut(5)) >= ROTARY_PASS_ROWS and sum(cut(5)) == 240
    assert len(cut(64)) == DEFAULT_SMS // 2 and sum(cut(64)) == 64 * 48
    assert max(cut(1)) < ROTARY_PASS_ROWS and sum(cut(1)) == 48


def test_rotary_parts_rotate_every_row_when_rotated_is_left_out(rt: Runtime) -> None:
    tokens, d = 3, 8
    cos = randn(rt, (tokens, d // 2), torch.float32, 12)
    sin = randn(rt, (1, d // 2), torch.float32, 13)  # broadcast over the rows
    split = randn(rt, (2, tokens, d), torch.float32, 14)
    out = run(rt, OpCall("rotary_parts", (split, cos, sin)))
    summed = split.cpu().double().sum(0)
    x1, x2 = summed.chunk(2, dim=-1)
    c, s = cos.cpu().double(), sin.cpu().double()
    assert_close(out, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


# -- scatter_rows into a KV cache ------------------------------------------------------------


def scattered(cache: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache with row index[r] = src row r for every in-range index, by a loop over src's rows
    (rows numbered row-major over all dims but the last)."""
    new = cache.cpu().clone(memory_format=torch.contiguous_format)
    rows = new.view(-1, new.shape[-1])
    srcs = src.cpu().reshape(-1, src.shape[-1])
    for r, i in enumerate(index.cpu().expand(src.shape[:-1]).flatten().tolist()):
        if 0 <= i < rows.shape[0]:
            rows[i] = srcs[r].to(new.dtype)
    return new


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_scatter_appends_tokens_to_a_kv_pool_with_padding_rows(
    rt: Runtime, dtype: torch.dtype, tokens: int
) -> None:
    slots, max_len, kv_heads, d = 4, 96, 2, 64
    pool = randn(rt, (slots, max_len, kv_heads, d), dtype, 12)
    src = randn(rt, (tokens, kv_heads, d), dtype, 13)
    # token t goes to slot t % slots at position t // slots; every third token is padding
    index = [
        [
            -1 if t % 3 == 2 else ((t % slots) * max_len + t // slots) * kv_heads + h
            for h in range(kv_heads)
        ]
        for t in range(tokens)
    ]
    index[0][0] = slots * max_len * kv_heads  # one past the cache: skipped too
    index = ints(rt, index)
    expect = scattered(pool, src, index)
    assert run(rt, OpCall("scatter_rows", (src, index), out=pool)) is pool
    assert torch.equal(pool.cpu(), expect)


def test_scatter_records_leave_the_sms_free_past_a_few_rows() -> None:
    """A step's KV append of 64 rows is 8 records of 8 rows (a warp each), not a record per row
    that would hold 64 SMs from what runs next; up to 32 rows, a record per row; 512 prefill
    rows, one wave of 64 records; rows too long for 8 in a tile, as many as fit."""

    def cut(rows: int, width: int) -> list[int]:
        with Runtime("cpu") as runtime:
            cache = torch.zeros(rows, width)
            task = runtime.prepare(
                OpCall("scatter_rows", (cache, torch.zeros(rows, dtype=I32)), out=cache)
            )
        return [e - b for b, e in family("scatter_rows").ranges(task, 16384)]

    assert cut(64, 768) == [SCATTER_RECORD_ROWS] * 8
    assert cut(SCATTER_SPREAD, 768) == [1] * SCATTER_SPREAD
    assert cut(1, 768) == [1]
    assert cut(512, 768) == [8] * 64
    assert cut(40, 4096) == [4] * 10


def test_scatter_into_a_non_contiguous_cache_view_converting_dtype(rt: Runtime) -> None:
    buffer = torch.full((3, 10, 2, 24), 7.0, dtype=torch.float16, device=rt.device)
    cache = buffer[:, 1:, :, 4:20].transpose(1, 2)  # [3, 2, 9, 16], strided rows
    src = randn(rt, (4, 1, 16), torch.float32, 14)
    index = ints(rt, [[0], [53], [-1], [27]])  # broadcast over src's size-1 dim
    expect = scattered(cache, src, index)
    run(rt, OpCall("scatter_rows", (src, index), out=cache))
    assert torch.equal(cache.cpu(), expect)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:, 1:, :, 4:20] = False
    assert (buffer[outside] == 7).all()  # nothing written around the view


# -- one decode program, built once, rerun with new indices (data moves, the program does not) --


def test_a_decode_program_reruns_with_new_positions_slots_and_lengths(rt: Runtime) -> None:
    slots, max_len, heads, d = 3, 16, 2, 8
    keys = torch.zeros((slots, heads, max_len, d), device=rt.device)
    angle = randn(rt, (max_len, d // 2), torch.float32, 15)
    cos, sin = angle.cos(), angle.sin()
    k_new, q = torch.empty((slots, heads, d), device=rt.device), torch.empty_like(keys[:, :, 0])
    positions, lengths = ints(rt, [[0]] * slots), ints(rt, [[0]] * slots)
    rows = ints(rt, [[0] * heads] * slots)
    build = rt.program()  # rotate the new keys, append them to the cache, attend over it
    build.add(OpCall("rotary", (k_new, cos, sin, positions), out=k_new))
    build.add(OpCall("scatter_rows", (k_new, rows), out=keys))
    out = build.add(OpCall("attention_decode", (q, keys, keys, lengths)))
    step = build.build()
    expect = keys.cpu()
    for n in range(4):
        at = [n, 2 * n, -1 if n % 2 else n]  # slot 2 idles every other step
        k_new.copy_(randn(rt, k_new.shape, torch.float32, 20 + n))
        q.copy_(randn(rt, q.shape, torch.float32, 30 + n))
        positions.copy_(ints(rt, [[max(p, 0)] for p in at]))
        rows.copy_(
            ints(
                rt,
                [
                    [(s * heads + h) * max_len + p if p >= 0 else -1 for h in range(heads)]
                    for s, p in enumerate(at)
                ],
            )
        )
        lengths.copy_(ints(rt, [[p + 1] for p in at]))
        expect = scattered(expect, gathered_rotary(k_new, cos, sin, positions), rows)
        rt.submit(step).wait(30)
        assert_close(keys, expect)
        assert_close(out, sliced_attention(q[:, :, None], expect, expect, lengths)[:, :, 0])


def test_run_reference_of_index_operators_matches_the_runtime(rt: Runtime) -> None:
    """The engine's torch path (run_reference) agrees with the operators, scatter included."""
    q, k = randn(rt, (3, 8), torch.float32, 16), randn(rt, (3, 5, 8), torch.float32, 17)
    cache = randn(rt, (6, 8), torch.float32, 18)
    split = randn(rt, (2, 3, 5, 8), torch.float32, 19)
    calls = [
        OpCall("attention_decode", (q, k, k, ints(rt, [5, 0, 2]))),
        OpCall("rotary", (q, k[0, :, :4], k[1, :, :4], ints(rt, [4, 1, 9]))),
        OpCall(
            "rotary_parts",
            (split, k[0, :, :4], k[1, :, :4], ints(rt, [[4], [1], [9]])),
            scalars={"rotated": 3},
        ),
        OpCall("scatter_rows", (q, ints(rt, [5, -1, 0])), out=cache.clone()),
    ]
    for call in calls:
        ref = run_reference(CATALOGUE[call.op], call)
        assert_close(run(rt, call), ref.double())


# -- validation ------------------------------------------------------------------------------


def test_index_inputs_are_validated(rt: Runtime) -> None:
    x, k = torch.zeros(2, 3, 8, device=rt.device), torch.zeros(2, 3, 10, 8, device=rt.device)
    table = torch.zeros(10, 4, device=rt.device)
    good = ints(rt, [[1], [2]])
    cases = [
        (
            OpCall("attention_decode", (x, k, k, good.float())),
            "input 3 (lengths) is an index tensor: it must be int32, got torch.float32",
        ),
        (OpCall("attention_decode", (x, k, k, good.long())), "must be int32, got torch.int64"),
        (
            OpCall("attention_decode", (x, k, k, good[None])),
            "attention lengths (1, 2, 1) must broadcast to the leading dims (2, 3)",
        ),
        (
            OpCall("attention_decode", (x, k, good, good)),
            "input 2 has dtype torch.int32; use float32, float16 or bfloat16 (only its lengths",
        ),
        (
            OpCall("rotary", (x, table, table, good.float())),
            "input 3 (positions) is an index tensor",
        ),
        (
            OpCall("rotary", (x, table[None], table[None], good)),
            "cos and sin must be tables [P, 4]",
        ),
        (OpCall("rotary", (x, table, table[:3], good)), "cos and sin must be tables [P, 4]"),
        (
            OpCall("rotary", (x, table, table, good[None])),
            "rotary positions (1, 2, 1) must broadcast",
        ),
        (
            OpCall("rotary_parts", (x[None].expand(7, 2, 3, 8), table, table, good)),
            "the S partial sums of a linear_parts with 1 <= S <= 6, got (7, 2, 3, 8)",
        ),
        (OpCall("rotary_parts", (x[0, 0], table, table)), "rotary_parts input 0 must have 2"),
        (OpCall("scatter_rows", (x, good)), "out= (the cache"),
        (OpCall("scatter_rows", (x, good.float()), out=k), "input 1 (index) is an index tensor"),
        (
            OpCall("scatter_rows", (x, good), out=torch.zeros(4, 9, device=rt.device)),
            "out's last dim must be src's (8)",
        ),
        (OpCall("scatter_rows", (x, ints(rt, [1, 2])), out=k), "scatter_rows index"),
        (OpCall("add", (x, good)), "(it takes no int32 index input)"),
        (OpCall("softmax", (x, good)), "softmax takes 1 tensor input(s), got 2"),
    ]
    for call, message in cases:
        with pytest.raises(TensorSpecError, match=re.escape(message)):
            rt.prepare(call)
