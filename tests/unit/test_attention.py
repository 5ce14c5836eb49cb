"""Attention decode split over the KV length (issue 12): each backend against SDPA in float64 for
ragged lengths 1..4096, grouped-query heads, every float dtype, the tensor-core and CUDA-core
paths (head dims 64, 128 and 80), lengths 0, negative and past the cache, one long row and 64
short ones, a program rerun with new lengths, bitwise reproducible runs, the same in warp mode
(many groups: a warp an item); and the plan that cuts the work (splits and mode from shapes only,
each row written once whatever the records)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from test_catalogue import DTYPES
from test_index_ops import assert_close, ints, randn, run, sliced_attention

from gpuos_core import OpCall, Runtime, families as fam
from gpuos_core.errors import TensorSpecError
from gpuos_core.families import AttentionPlan
from gpuos_core.paths import CUDA_DIR


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def cache(
    rt: Runtime,
    requests: int,
    kv_heads: int,
    capacity: int,
    d: int,
    dtype: torch.dtype,
    lengths: list[int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [requests, kv_heads, capacity, d], NaN past each request's length (never read)."""
    k, v = (randn(rt, (requests, kv_heads, capacity, d), dtype, seed + i) for i in range(2))
    for b, n in enumerate(lengths):
        k[b, :, max(n, 0) :], v[b, :, max(n, 0) :] = float("nan"), float("nan")
    return k, v


def decode_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
) -> OpCall:
    """The engine's call: q [R, Hkv, G, D] over K, V [R, Hkv, L, D] broadcast over the group, one
    length per request."""
    n = lengths.view(-1, 1, 1)
    return OpCall("attention_decode", (q, k[:, :, None], v[:, :, None], n), out=out)


def check_decode(
    rt: Runtime,
    lengths: list[int],
    kv_heads: int,
    group: int,
    d: int,
    dtype: torch.dtype,
    capacity: int | None = None,
    seed: int = 0,
) -> None:
    capacity = capacity or max(max(lengths), 1)
    k, v = cache(rt, len(lengths), kv_heads, capacity, d, dtype, lengths, seed)
    q = randn(rt, (len(lengths), kv_heads, group, d), dtype, seed + 2)
    n = ints(rt, lengths)
    out = run(rt, decode_call(q, k, v, n))
    assert_close(out, sliced_attention(q, k, v, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 80])  # 80: the CUDA-core path
@pytest.mark.parametrize("kv_heads, group", [(4, 1), (2, 4)])
def test_ragged_lengths_up_to_4096_match_sdpa(
    rt: Runtime, dtype: torch.dtype, d: int, kv_heads: int, group: int
) -> None:
    rng = random.Random(d * 10 + group)
    lengths = [1, 4096, 127, 128, 129, 1000] + [rng.randint(1, 4096) for _ in range(4)]
    check_decode(rt, lengths, kv_heads, group, d, dtype, seed=d + group)


@pytest.mark.parametrize("d", [32, 256])
def test_head_dims_32_and_256_with_a_group_larger_than_an_item(rt: Runtime, d: int) -> None:
    """Groups of 8 queries: more than an item takes at D = 256, so a group spans two items."""
    check_decode(rt, [300, 5, 2048], 1, 8, d, torch.float16, seed=d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_long_row_and_64_short_rows(rt: Runtime, dtype: torch.dtype) -> None:
    check_decode(rt, [4096], 8, 4, 128, dtype, seed=1)  # one request: its keys split many ways
    rng = random.Random(64)
    check_decode(rt, [rng.randint(1, 64) for _ in range(64)], 4, 2, 64, dtype, seed=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 80])  # 80: the CUDA-core path
def test_the_newest_keys_and_values_come_from_new_k_and_new_v(
    rt: Runtime, dtype: torch.dtype, d: int
) -> None:
    """The decode step's order: each row's newest key and value (at its length - 1) are read
    from the projection's rows, while the cache does not hold them yet (NaN there)."""
    lengths = [1, 130, 7, 0, 300, 2000]  # past the cache too: its last key is the newest
    k, v = cache(rt, 6, 2, 300, d, dtype, lengths, seed=5)
    q = randn(rt, (6, 2, 4, d), dtype, 7)
    new_k, new_v = (randn(rt, (6, 2, d), dtype, 8 + i) for i in range(2))
    full_k, full_v = k.clone(), v.clone()
    for b, n in enumerate(lengths):
        if n > 0:
            last = min(n, 300) - 1
            full_k[b, :, last], full_v[b, :, last] = new_k[b], new_v[b]
            k[b, :, last], v[b, :, last] = float("nan"), float("nan")
    n = ints(rt, lengths)
    newest = (new_k[:, :, None], new_v[:, :, None])
    call = decode_call(q, k, v, n)
    out = run(rt, OpCall(call.op, (*call.inputs, *newest)))
    assert_close(out, sliced_attention(q, full_k, full_v, n))


def test_newest_keys_that_do_not_fit_the_cache_are_refused(rt: Runtime) -> None:
    k, v = cache(rt, 2, 1, 16, 64, torch.float16, [16, 16], 1)
    q = randn(rt, (2, 1, 1, 64), torch.float16, 2)
    call = decode_call(q, k, v, ints(rt, [3, 16]))
    new = randn(rt, (2, 1, 1, 64), torch.float16, 3)
    with pytest.raises(TensorSpecError, match="pair"):
        rt.prepare(OpCall(call.op, (*call.inputs, new)))
    with pytest.raises(TensorSpecError, match="dtype"):
        rt.prepare(OpCall(call.op, (*call.inputs, new.float(), new)))
    with pytest.raises(TensorSpecError, match="broadcast"):
        rt.prepare(OpCall(call.op, (*call.inputs, new[..., :32], new)))


def test_lengths_zero_negative_and_past_the_cache_with_grouped_heads(rt: Runtime) -> None:
    lengths = [0, -3, 17, 600, 100000]  # past the cache: clamped to its 600 keys
    k, v = cache(rt, 5, 2, 600, 128, torch.float16, [0, 0, 17, 600, 600], 3)
    q = randn(rt, (5, 2, 4, 128), torch.float16, 4)
    n = ints(rt, lengths)
    out = torch.full_like(q, float("nan"))
    run(rt, decode_call(q, k, v, n, out=out))
    assert (out[:2] == 0).all()  # no key: zeros, not NaN
    assert_close(out, sliced_attention(q, k, v, n))


def test_a_fixed_program_reruns_with_new_lengths(rt: Runtime) -> None:
    requests, kv_heads, group, capacity, d = 3, 2, 4, 1024, 128
    k, v = (randn(rt, (requests, kv_heads, capacity, d), torch.float16, s) for s in (5, 6))
    q = randn(rt, (requests, kv_heads, group, d), torch.float16, 7)
    lengths = ints(rt, [1, 1, 1])
    build = rt.program()
    out = build.add(decode_call(q, k, v, lengths))
    step = build.build()
    records = len(step.tasks.records)
    for n in ([1, 1024, 0], [700, 3, 1024], [129, 128, -1], [1024, 1024, 1024]):
        lengths.copy_(ints(rt, n))
        rt.submit(step).wait(30)
        assert_close(out, sliced_attention(q, k, v, lengths))
    assert len(step.tasks.records) == records


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_warp_mode_over_ragged_rows_reruns_and_reproduces(
    rt: Runtime, dtype: torch.dtype, d: int
) -> None:
    """192 groups of 2 queries over 1024 slots, each row with its own length: split edges (255,
    256, 257), none (0, -1), one key, the whole cache and past it; then the same program over new
    lengths, twice (the second run bitwise the first's)."""
    requests, kv_heads, group, capacity = 48, 4, 2, 1024
    k, v = (randn(rt, (requests, kv_heads, capacity, d), dtype, s) for s in (10, 11))
    q = randn(rt, (requests, kv_heads, group, d), dtype, 12)
    rng = random.Random(d)
    edges = [0, -1, 1, 255, 256, 257, 1024, 5000]
    lengths = ints(rt, edges + [rng.randint(1, 1024) for _ in range(requests - len(edges))])
    call = decode_call(q, k, v, lengths)
    assert AttentionPlan.of(*rt.prepare(call).inputs).warps
    build = rt.program()
    out = build.add(call)
    step = build.build()
    for n in (lengths.tolist(), [rng.randint(-2, 1100) for _ in range(requests)]):
        lengths.copy_(ints(rt, n))
        rt.submit(step).wait(30)
        assert_close(out, sliced_attention(q, k, v, lengths))
        first = out.clone()
        rt.submit(step).wait(30)
        assert torch.equal(out, first)


def chunk_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> OpCall:
    """The prefill step's call for a chunk: q [Hkv, G, R, D], its R rows innermost, over one
    slot's K and V [Hkv, L, D] (broadcast over the group and the rows), a length per row."""
    shape = (*q.shape[:-1], *k.shape[-2:])
    n = lengths.view(1, 1, -1)
    return OpCall(
        "attention_decode", (q, k[:, None, None].expand(shape), v[:, None, None].expand(shape), n)
    )


def chunk_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """sliced_attention with each of the chunk's rows as a request of its own."""
    rows = q.shape[2]
    own = [x[None].expand(rows, *x.shape) for x in (k, v)]
    return sliced_attention(q.movedim(2, 0), *own, lengths).movedim(0, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "d, capacity, kv_heads, group, nq",
    [(64, 1024, 2, 4, 8), (128, 1024, 2, 4, 4), (64, 4096, 1, 1, 8), (80, 600, 2, 4, 4)],
    ids=["d64-warp", "d128-warp", "d64-block", "d80-cuda-cores"],
)
def test_a_chunks_rows_share_items_each_over_its_own_length(
    rt: Runtime, dtype: torch.dtype, d: int, capacity: int, kv_heads: int, group: int, nq: int
) -> None:
    """A prefill chunk's 24 rows over one slot (2 KV heads of 4 queries, or one): up to 8 rows
    an item, each masked at its own length (split edges, one key, none, negative, past the
    cache; the last 8 rows of the second run all without keys, an item with nothing to do), over
    several splits in warp mode, in block mode and on CUDA cores; each against SDPA, then the same
    program over new lengths, twice (the second run bitwise the first's). Keys past the longest
    row are NaN: never read."""
    rows = 24
    k, v = cache(rt, 1, kv_heads, capacity, d, dtype, [capacity], seed=d)
    q = randn(rt, (kv_heads, group, rows, d), dtype, seed=d + 1)
    rng = random.Random(capacity + d)
    edges = [0, -1, 1, 255, 256, 257, 5000, 17]
    first = edges + [rng.randint(1, capacity) for _ in range(rows - len(edges))]
    second = [rng.randint(-2, capacity) for _ in range(rows - 8)] + [0] * 8
    longest = max(min(n, capacity) for n in first + second)
    k[:, :, longest:], v[:, :, longest:] = float("nan"), float("nan")
    k, v = k[0], v[0]
    lengths = ints(rt, first)
    call = chunk_call(q, k, v, lengths)
    plan = AttentionPlan.of(*rt.prepare(call).inputs)
    assert (plan.ragged, plan.group, plan.nq) == (True, group * rows, nq)
    assert plan.splits > 1 and plan.warps == (capacity <= 1024)  # D = 80: block mode on a GPU
    build = rt.program()
    out = build.add(call)
    step = build.build()
    for n in (first, second):
        lengths.copy_(ints(rt, n))
        rt.submit(step).wait(30)
        assert_close(out, chunk_reference(q, k, v, lengths))
        assert (out[:, :, [i for i, m in enumerate(n) if m <= 0]] == 0).all()
        again = out.clone()
        rt.submit(step).wait(30)
        assert torch.equal(out, again)


def test_runs_are_bitwise_reproducible(rt: Runtime) -> None:
    lengths = [4096, 37, 2000]
    k, v = cache(rt, 3, 2, 4096, 128, torch.bfloat16, lengths, 8)
    q = randn(rt, (3, 2, 4, 128), torch.bfloat16, 9)
    task = rt.prepare(decode_call(q, k, v, ints(rt, lengths)))
    first = rt.submit([task]).wait(30).result(0).clone()
    for _ in range(3):
        assert torch.equal(rt.submit([task]).wait(30).result(0), first)


# -- the plan --------------------------------------------------------------------------------


def test_constants_agree_with_the_cuda_header() -> None:
    text = (CUDA_DIR / "ops" / "attention.cuh").read_text()
    defines = dict(re.findall(r"#define (GPUOS_ATTN_\w+) (\w+)", text))
    tile, warps = int(defines["GPUOS_ATTN_TILE"]), int(defines["GPUOS_ATTN_WARPS"])
    assert fam.ATTENTION_ALIGN == tile * warps
    assert fam.ATTENTION_ACC == int(defines["GPUOS_ATTN_ACC"])
    assert fam.ATTENTION_MAX_Q == int(defines["GPUOS_ATTN_MAX_Q"])
    assert fam.ATTENTION_HEADER == int(defines["GPUOS_ATTN_HEADER"])


def views(
    rows: int, kv_heads: int, group: int, keys: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.zeros(rows, kv_heads, group, d)
    k = torch.zeros(rows, kv_heads, 1, keys, d).expand(rows, kv_heads, group, keys, d)
    return q, k, k, torch.zeros(rows, 1, 1, dtype=torch.int32).expand(rows, kv_heads, group)


def test_plan_splits_few_long_rows_and_not_many() -> None:
    one = AttentionPlan.of(*views(1, 8, 4, 4096, 128))
    assert (one.group, one.nq, one.groups) == (4, 4, 8)
    assert one.splits == 32 and one.chunk == 128  # as many as 128-key chunks allow
    many = AttentionPlan.of(*views(64, 32, 1, 2048, 128))  # too many keys for warp mode
    assert (many.groups, many.splits, many.chunk, many.warps) == (2048, 1, 2048, False)
    wide = AttentionPlan.of(*views(2, 1, 8, 1000, 256))
    assert (wide.nq, wide.subgroups, wide.groups) == (2, 4, 8)
    assert wide.splits * wide.chunk >= 1000 > (wide.splits - 1) * wide.chunk


def test_plan_takes_warp_mode_for_a_group_per_sm_or_more() -> None:
    decode = AttentionPlan.of(*views(64, 12, 1, 1024, 64))  # GPT-2 small, 64 rows, 1024 slots
    assert (decode.groups, decode.warps, decode.splits, decode.chunk) == (768, True, 4, 256)
    short = AttentionPlan.of(*views(64, 12, 1, 65, 64))
    assert (short.warps, short.splits) == (True, 1)
    few = AttentionPlan.of(*views(8, 12, 1, 1024, 64))  # 96 groups: fewer than the SMs
    assert not few.warps and few.splits == 4
    long = AttentionPlan.of(*views(64, 8, 4, 1025, 64))  # 5 splits of 256 keys: block mode
    assert (long.groups, long.warps, long.splits) == (512, False, 2)


def test_a_prefill_chunk_reading_one_slot_is_cut_for_its_share_of_the_sms(rt: Runtime) -> None:
    """A prefill chunk's 16 rows read one slot's keys (K and V broadcast over the rows, a length
    each): its task is cut for a 16th of the SMs, the step's other chunks taking the rest, so
    it is 24 records of 8 groups, not a record per SM; where the call says 32 tasks share the
    machine (OpCall.share: a step of 32 chunks), a record per SM of a 32nd, so that the step's
    chunks are one wave of records, not six; rows of their own slots take a record for each 8
    items (a warp an item), as many as the SMs allow. A share below one is refused."""
    rows, heads, keys, d = 16, 12, 1024, 64
    q = torch.zeros(rows, heads, 1, d, device=rt.device)
    own = torch.zeros(rows, heads, 1, keys, d, device=rt.device)
    slot = own[:1].expand(rows, heads, 1, keys, d)
    lengths = ints(rt, list(range(1, rows + 1))).view(rows, 1, 1)
    every, sms = lengths.expand(rows, heads, 1), fam.sm_count(q.device)
    chunk = AttentionPlan.of(q, slot, slot, every)
    assert (chunk.readers, chunk.sms(q.device)) == (16, -(-sms // 16))
    assert AttentionPlan.of(q, own, own, every).sms(q.device) == sms

    def records(k: torch.Tensor, share: int | None = None) -> int:
        task = rt.prepare(OpCall("attention_decode", (q, k, k, lengths), share=share))
        return len(fam.family("attention_decode").ranges(task, 16384))

    items = AttentionPlan.of(q, own, own, every).items
    assert (records(slot), records(own)) == (
        rows * heads // fam.ATTENTION_WARPS,
        min(-(-items // fam.ATTENTION_WARPS), sms),
    )
    assert records(slot, share=32) == sms // 32
    with pytest.raises(TensorSpecError, match="share must be at least 1"):
        records(slot, share=0)


def test_a_chunks_rows_group_over_their_lengths_unless_their_newest_keys_come_apart() -> None:
    """Rows that share K and V group whatever their lengths (ragged), up to 8 an item, where the
    lengths alone moved them into items of their own; with new_k and new_v each row has a newest
    key of its own, so they group only over rows of one length. The plan's header says which."""
    heads, rows, keys, d = 12, 16, 128, 64
    q = torch.zeros(heads, 1, rows, d)
    slot = torch.zeros(heads, 1, 1, keys, d).expand(heads, 1, rows, keys, d)
    lengths = torch.arange(rows, dtype=torch.int32).view(1, 1, rows).expand(heads, 1, rows)
    chunk = AttentionPlan.of(q, slot, slot, lengths)
    assert (chunk.group, chunk.nq, chunk.groups, chunk.ragged) == (rows, 8, heads * 2, True)
    assert chunk.readers == rows  # the machine's share it is cut for, as before (one per row)
    apart = AttentionPlan.of(q, slot, slot, lengths, newest=True)
    assert (apart.group, apart.groups, apart.ragged) == (1, heads * rows, False)
    assert chunk.workspace(q.device)[6] == 1 and apart.workspace(q.device)[6] == 0


def test_warp_mode_records_take_a_warp_an_item_and_leave_the_other_sms_free() -> None:
    """64 decode rows x 12 heads of GPT-2 over 65 keys: 768 items of one (row, head) each, in 96
    records of 8 (one per warp), not one per SM: the 36 SMs left free claim the next stage's
    records while attention runs. 16 rows over 1,024 keys are 4 splits of 192 groups: the same
    768 items, still a warp each. More items than the SMs' warps: a record of 8 groups each."""

    def records(rows: int, keys: int) -> tuple[int, int]:
        with Runtime("cpu") as runtime:  # cut for DEFAULT_SMS multiprocessors
            task = runtime.prepare(OpCall("attention_decode", views(rows, 12, 1, keys, 64)))
        return task.items, len(fam.family("attention_decode").ranges(task, 16384))

    assert records(64, 65) == (768, 96)
    assert records(16, 1024) == (768, 96)
    assert records(256, 65) == (3072, 3072 // fam.ATTENTION_WARPS)


def test_each_row_is_owned_by_exactly_one_record_whatever_the_cut() -> None:
    plan = AttentionPlan.of(*views(3, 2, 7, 1000, 64))  # groups of 7 rows: items of 7 and 0
    assert plan.nq == 7 and plan.splits > 1
    rng = random.Random(3)
    for _ in range(20):
        cuts = sorted({0, plan.items, *(rng.randrange(plan.items) for _ in range(5))})
        rows = torch.cat([plan.owned_rows(a, b) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(rows, torch.arange(plan.rows))


def test_items_depend_on_shapes_not_lengths(rt: Runtime) -> None:
    q, k, _, _ = views(4, 2, 2, 512, 64)
    q, k = q.to(rt.device), k.to(rt.device)
    counts = {
        rt.prepare(OpCall("attention_decode", (q, k, k, ints(rt, n).view(4, 1, 1)))).items
        for n in ([1, 1, 1, 1], [512, 0, -5, 9000])
    }
    assert len(counts) == 1


def test_the_encoded_lengths_carry_the_workspace(rt: Runtime) -> None:
    q, k, _, _ = views(2, 2, 2, 300, 64)
    task = rt.prepare(
        OpCall("attention_decode", (q.to(rt.device), k.to(rt.device), k.to(rt.device)))
    )
    control = task.inputs[3]
    assert control.shape == (2, 2, 2, 1) and (control == 300).all()  # no lengths: L keys
    workspace = control.workspace
    assert control.stride(-1) * 4 == workspace.data_ptr()
    plan = AttentionPlan.of(*task.inputs)
    assert workspace.numel() == plan.workspace_words
    header = [plan.group, plan.nq, plan.chunk, plan.splits, plan.warps]
    assert workspace[: fam.ATTENTION_HEADER].tolist() == header + [0] * (fam.ATTENTION_HEADER - 5)
