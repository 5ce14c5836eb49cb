"""The transparent scheduler runs unmodified PyTorch snippets to eager's results, batches and fuses
the small elementwise work, and flushes before anything can observe an unwritten result. Every
snippet also runs traced: recorded once, then replayed on new inputs, still eager's results
(tests/unit/test_trace.py has the guards and the rest of tracing)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from gpuos_core import Runtime, Scheduler, SchedulerConfig, scheduler

Snippet = Callable[..., object]


@pytest.fixture(scope="module")
def rt(backend: str) -> Iterator[Runtime]:
    with Runtime(backend) as runtime:
        yield runtime


def rand(rt: Runtime, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=rt.device).to(dtype)


def compare(
    rt: Runtime,
    fn: Snippet,
    *inputs: torch.Tensor,
    fuse: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    replays: bool = True,
) -> Scheduler:
    """Runs `fn` eagerly, under a scheduler and traced (see `traced`) on the same inputs;
    results must agree. The scheduler of the plain run, for its stats."""
    want = fn(*inputs)
    with scheduler(rt, auto_flush_ms=None, fuse=fuse) as sched:
        got = fn(*inputs)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    traced(rt, fn, inputs, fuse, replays, atol=atol, rtol=rtol)
    return sched


def traced(
    rt: Runtime,
    fn: Snippet,
    inputs: tuple[torch.Tensor, ...],
    fuse: bool,
    replays: bool,
    **tolerance: float,
) -> None:
    """`fn` traced: recorded on `inputs`, then called on new inputs like them and on `inputs`
    again. Every call's results equal eager's, also after the later calls ran (a replay writes
    new tensors); the later calls replay, or (`replays` False) say why they cannot."""
    region = Scheduler(rt, SchedulerConfig(auto_flush_ms=None, fuse=fuse)).trace(fn)
    fresh = tuple(torch.randn_like(x) for x in inputs)
    calls = [(args, region(*args)) for args in (inputs, fresh, inputs)]
    for args, got in calls:
        torch.testing.assert_close(got, fn(*args), **tolerance)
    stats = region.stats
    assert stats.replayed == (2 if replays else 0), stats
    assert (stats.recorded, stats.misses) == ((1, 1) if replays else (0, 1)), stats
    assert replays or sum(stats.not_replayable.values()) == 3, stats


def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(torch.relu((x + y) * 0.5)) / 1.5


def test_mlp_block_runs_matmuls_in_torch_and_activations_on_the_runtime(rt: Runtime) -> None:
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    mlp = mlp.to(rt.device)
    x = rand(rt, 4, 32)
    with torch.no_grad():
        sched = compare(rt, lambda x: mlp(x) + x, x, replays=False)  # addmm runs in torch
    assert sched.stats.fallbacks["aten.addmm.default"] == 2
    assert sched.stats.intercepted == 2 and sched.stats.tasks == 2  # gelu, residual add


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: F.silu(x) * y,
        lambda x, y: F.gelu(x * y + 1.0),
        lambda x, y: F.gelu(x, approximate="tanh") - F.silu(y),
        lambda x, y: F.leaky_relu(F.hardswish(x), 0.2) + F.hardsigmoid(y) * F.elu(y),
        lambda x, y: torch.clamp(F.softplus(x, beta=2.0), -0.5, 0.5) + F.hardtanh(y, -0.3, 0.3),
        lambda x, y: torch.maximum(torch.exp(-x.abs()), torch.sqrt(y * y).log().neg()),
        lambda x, y: (
            torch.pow(x.sin() + 2, y.cos()) + 2 ** x.tanh() + (1 - x).reciprocal().clamp(0, 4)
        ),
    ],
    ids=["silu_mul", "gelu_affine", "gelu_tanh_silu", "activations", "clamps", "math", "pow"],
)
def test_elementwise_chains_fuse_into_one_task_and_match_eager(rt: Runtime, fn: Snippet) -> None:
    sched = compare(rt, fn, rand(rt, 8, 33), rand(rt, 8, 33))
    assert sched.stats.tasks == 1 and sched.stats.fused == sched.stats.intercepted - 1


def test_a_fused_chain_needs_fewer_tasks_and_operators_than_unfused(rt: Runtime) -> None:
    x, y = rand(rt, 16, 64), rand(rt, 16, 64)
    before = len(rt.table.names())
    fused = compare(rt, chain, x, y, fuse=True)
    added_fused = len(rt.table.names()) - before
    unfused = compare(rt, chain, x, y, fuse=False)
    assert (fused.stats.tasks, fused.stats.submissions, fused.stats.fused) == (1, 1, 4)
    assert (unfused.stats.tasks, unfused.stats.submissions, unfused.stats.fused) == (5, 1, 0)
    assert added_fused <= 1 and fused.stats.registered <= 1
    assert unfused.stats.registered <= 2  # the scalar forms A * s0 and A / s0; add/relu: catalogue


def test_scalars_are_parameters_so_new_values_reuse_the_operator(rt: Runtime) -> None:
    x = rand(rt, 100)
    compare(rt, lambda x: torch.relu(x * 0.25 + 3.0), x)
    names = rt.table.names()
    for scale in (0.5, -1.5, 7.0):
        sched = compare(rt, lambda x, scale=scale: torch.relu(x * scale + 3.0), x)
        assert sched.stats.registered == 0
    assert rt.table.names() == names


def test_layernorm_written_by_hand_matches_eager(rt: Runtime) -> None:
    def layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        d = x - mu
        var = d.pow(2).mean(-1, keepdim=True)
        return d * torch.rsqrt(var + 1e-5) * w + b

    x, w, b = rand(rt, 6, 48), rand(rt, 48), rand(rt, 48)
    sched = compare(rt, layernorm, x, w, b)
    torch.testing.assert_close(
        layernorm(x, w, b), F.layer_norm(x, (48,), w, b, eps=1e-5), atol=1e-5, rtol=1e-4
    )
    # five tasks, each reading the one before: mean | d² | mean | d·rsqrt(var+eps)·w | + b (a
    # task reads at most 3 tensors); five dependency levels, one device program
    assert sched.stats.tasks == 5 and sched.stats.submissions == 1
    assert sched.stats.fused == 4 and not sched.stats.fallbacks


def test_single_token_softmax_attention_matches_eager(rt: Runtime) -> None:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        return torch.softmax(scores, dim=-1) @ v

    sched = compare(
        rt, attend, rand(rt, 4, 1, 32), rand(rt, 4, 37, 32), rand(rt, 4, 37, 32), replays=False
    )  # bmm runs in torch
    assert sched.stats.intercepted == 2 and sched.stats.tasks == 2  # the scaling, the softmax
    assert sched.stats.fallbacks["aten.bmm.default"] == 2


def test_softmax_over_any_dim_and_reductions_over_dims(rt: Runtime) -> None:
    x = rand(rt, 5, 6, 7)
    compare(rt, lambda x: (torch.softmax(x, 0), F.log_softmax(x, 1), F.log_softmax(x, -1)), x)
    compare(rt, lambda x: (x.sum(), x.sum((0, 2)), x.mean(1, keepdim=True), x.mean(), x.sum(-1)), x)


def test_in_place_update_of_a_pending_result_sees_its_value(rt: Runtime) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2
        y.add_(1)
        return y

    sched = compare(rt, fn, rand(rt, 64), replays=False)  # add_ runs in torch
    assert sched.stats.flushes == 1


def test_in_place_update_of_an_input_waits_for_the_pending_task(rt: Runtime) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.clone()
        y = torch.sigmoid(x)
        x.add_(1)  # y must see x before the update
        return y, torch.sigmoid(x)

    compare(rt, fn, rand(rt, 64), replays=False)  # clone and add_ run in torch


def test_views_of_pending_results_are_written_and_read_after_a_flush(rt: Runtime) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row = torch.tanh(x)[1:3]  # a view whose base is still pending
        col = (x * 3).t()[0]
        alias = torch.sigmoid(x).detach()  # an alias that does not keep its base alive
        return row, col * 2, torch.exp(row), alias  # ops reading views of pending results

    sched = compare(rt, fn, rand(rt, 4, 5), replays=False)  # views of results flush
    assert sched.stats.flushes >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtypes_follow_torch_promotion(rt: Runtime, dtype: torch.dtype) -> None:
    def fn(h: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, ...]:
        half = torch.tensor(0.5, device=h.device)  # 0-dim: does not promote h
        return h + f, F.silu(h) * 2, h * half, (h.float() * f).to(dtype)

    h, f = rand(rt, 3, 40, dtype=dtype), rand(rt, 3, 40)
    want = fn(h, f)
    with scheduler(rt, auto_flush_ms=None) as sched:
        got = fn(h, f)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert sched.stats.fallbacks.total() <= 1  # lift_fresh of the 0-dim constant


def test_reads_flush_item_tolist_and_printing(rt: Runtime) -> None:
    x = rand(rt, 10)
    total, values, text = torch.exp(x).sum().item(), torch.relu(x).tolist(), repr(x.abs() + 1)
    with scheduler(rt, auto_flush_ms=None) as sched:
        assert torch.exp(x).sum().item() == pytest.approx(total, rel=1e-5)
        assert sched.stats.flushes == 1
        assert torch.relu(x).tolist() == pytest.approx(values)
        assert sched.stats.flushes == 2
        assert repr(x.abs() + 1) == text
        assert sched.stats.flushes == 3


def test_out_variants_and_numpy_see_written_results(rt: Runtime) -> None:
    x = rand(rt, 50)
    want = torch.exp(x) + torch.sigmoid(x)
    out = torch.empty_like(x)
    with scheduler(rt, auto_flush_ms=None) as sched:
        torch.add(torch.exp(x), torch.sigmoid(x), out=out)  # out= runs in torch, after a flush
        y = torch.sigmoid(x) * 2
        array = y.numpy() if rt.device.type == "cpu" else y.cpu().numpy()
        assert sched.stats.flushes == 2
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.from_numpy(array).to(rt.device), torch.sigmoid(x) * 2)


def test_leaving_the_context_flushes(rt: Runtime) -> None:
    x = rand(rt, 256)
    with scheduler(rt, auto_flush_ms=None) as sched:
        y = F.gelu(x) + x
        assert sched.stats.flushes == 0
    assert sched.stats.flushes == 1
    torch.testing.assert_close(y, F.gelu(x) + x)


def test_the_auto_flush_timer_writes_results_nobody_reads_yet(rt: Runtime) -> None:
    x = rand(rt, 256)
    with scheduler(rt, auto_flush_ms=5.0) as sched:
        y = torch.sigmoid(x) * 3
        deadline = time.monotonic() + 5.0
        while sched.stats.flushes == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sched.stats.flushes == 1
    torch.testing.assert_close(y, torch.sigmoid(x) * 3)


def test_unsupported_ops_large_tensors_and_autograd_fall_back_to_torch(rt: Runtime) -> None:
    x, big = rand(rt, 32), rand(rt, 70_000)
    i = torch.randint(0, 9, (32,), device=rt.device)
    w = rand(rt, 32).requires_grad_()
    with scheduler(rt, auto_flush_ms=None) as sched:
        outs = (torch.erf(x), big * 2, i + 1, x.div(2, rounding_mode="floor"))
        loss = (torch.sigmoid(w) * x).sum()
        loss.backward()  # backward's own small ops may be intercepted: they need no grad
    for op in (
        "aten.erf.default",
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.div.Tensor_mode",
        "aten.sigmoid.default",
    ):
        assert sched.stats.fallbacks[op] >= 1
    torch.testing.assert_close(outs[1], big * 2)
    torch.testing.assert_close(w.grad, x * torch.sigmoid(w) * (1 - torch.sigmoid(w)))
