"""Device programs: a dependency graph of tasks in one submission gives the same results as the
same calls run one by one, on each backend; programs larger than the ring, concurrent submitters,
and operator swaps between runs."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from gpuos_core import CudaConfig, OpCall, Runtime, RuntimeConfig
from gpuos_core.abi import TASK_LOCAL, task_settled
from gpuos_core.errors import ProgramError, TaskFailedError
from gpuos_core.program import Arena, Program
from gpuos_core.tasklist import TaskList

BINARY = ("add", "mul", "sub", "maximum")
UNARY = ("relu", "sigmoid", "tanh", "neg", "softmax")
HALF = {"atol": 0.05, "rtol": 0.01}  # fp16 results of fp32 sums over 264 products


def runtime(backend: str, **cuda: object) -> Runtime:
    return Runtime(config=RuntimeConfig(backend=backend, cuda=CudaConfig(**cuda)))


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def random_calls(rt: Runtime, n: int, seed: int) -> tuple[list[OpCall], list[tuple[int, ...]]]:
    """A random DAG: each call reads fresh tensors or earlier results (chains, diamonds, fan-in),
    some results are overwritten later through `out=` (write after read), some calls carry an
    explicit `after=`. Inputs are CPU-drawn so both backends see the same numbers."""
    gen, pick = torch.Generator().manual_seed(seed), random.Random(seed)
    shape = (pick.choice((3, 40, 130)), pick.choice((7, 64, 301)))
    fresh = [torch.randn(shape, generator=gen).to(rt.device) for _ in range(4)]
    made: list[torch.Tensor] = []
    calls, after = [], []
    for i in range(n):
        pool = fresh + made
        op = pick.choice(BINARY + UNARY)
        args = tuple(pick.choice(pool) for _ in range(1 if op in UNARY else 2))
        out = (
            pick.choice(made)
            if made and pick.random() < 0.15
            else torch.empty(shape, device=rt.device)
        )
        calls.append(OpCall(op, args, out=out))
        after.append(tuple(pick.sample(range(i), min(i, 2))) if pick.random() < 0.1 else ())
        made.append(out)
    return calls, after


def one_by_one(rt: Runtime, calls: list[OpCall]) -> list[torch.Tensor]:
    """The same calls, each submitted alone and waited for, on copies of their outputs."""
    twins: dict[int, torch.Tensor] = {}

    def twin(x: torch.Tensor) -> torch.Tensor:
        return twins.get(id(x), x)

    for call in calls:
        out = twins.setdefault(id(call.out), call.out.clone())
        rt.submit([rt.prepare(OpCall(call.op, tuple(map(twin, call.inputs)), out=out))]).wait(30)
    return [twins[id(c.out)] for c in calls]


@pytest.mark.parametrize("seed", range(6))
def test_random_dags_equal_the_calls_run_one_by_one(rt: Runtime, seed: int) -> None:
    calls, after = random_calls(rt, 40, seed)
    want = one_by_one(rt, calls)
    build = rt.program()
    for call, order in zip(calls, after):
        build.add(call, after=order)
    program = build.build()
    for _ in range(2):  # a program runs again with no re-encoding, same answers
        for call in calls[::3]:
            call.out.fill_(float("nan"))  # every result is recomputed by the run
        rt.submit(program).wait(30).results()
        for got, ref in zip((c.out for c in calls), want):
            assert torch.equal(got, ref)


def chain_program(
    rt: Runtime, arena: Arena, x: torch.Tensor, depth: int
) -> tuple[Program, torch.Tensor]:
    """sigmoid(x) then `depth` - 1 more steps of tanh(h) + x, outputs from `arena`."""
    build = rt.program(arena)
    h = build.add(OpCall("sigmoid", (x,)))
    for _ in range(depth - 1):
        h = build.add(OpCall("add", (build.add(OpCall("tanh", (h,))), x)))
    return build.build(), h


def chain_reference(x: torch.Tensor, depth: int) -> torch.Tensor:
    h = torch.sigmoid(x)
    for _ in range(depth - 1):
        h = torch.tanh(h) + x
    return h


def test_programs_on_one_arena_share_its_memory_and_each_computes_its_own(rt: Runtime) -> None:
    """Programs run one at a time (the engine's steps of one parity) may overlay their
    intermediates: each still gets its own answer when they alternate, and one that needs more
    than the arena holds grows it without moving the programs built before."""
    arena = Arena(rt.device)
    x = torch.randn(64, 300).to(rt.device)
    small, small_out = chain_program(rt, arena, x[:16], 3)
    first = arena.bytes
    big, big_out = chain_program(rt, arena, x, 40)  # 40 x 2 intermediates of 75 KB: grows
    again, again_out = chain_program(rt, arena, x[:16], 5)  # back at the new buffer's start
    assert arena.bytes > first
    assert again_out.untyped_storage().data_ptr() == big_out.untyped_storage().data_ptr()
    for program, out, rows, depth in ((small, small_out, 16, 3), (big, big_out, 64, 40)) * 2 + (
        (again, again_out, 16, 5),
    ):
        rt.submit(program).wait(30).results()
        torch.testing.assert_close(out, chain_reference(x[:rows], depth), rtol=1e-5, atol=1e-5)


def test_a_rebound_program_runs_over_new_tensors_and_leaves_the_old_ones(rt: Runtime) -> None:
    """A Binding moves a program's inputs (views included) and outputs to other tensors, every
    tile of a task (the CPU runtime here tiles too); the intermediate stays where it was built,
    and results already written stay as they are."""

    def tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.randn(9, 300).to(rt.device),
            torch.randn(8, 300).to(rt.device),
            torch.empty(8, 300, device=rt.device),
        )

    x, y, out = tensors()
    build = rt.program()
    h = build.add(OpCall("sigmoid", (x[1:],)))  # reads a view of x, one row in
    build.add(OpCall("add", (h, y), out=out))
    program = build.build()
    addresses = [x.data_ptr(), y.data_ptr(), out.data_ptr()]
    # (task, operand, slot): the sigmoid's input views x, the add reads y and writes out
    binding = program.binding([(0, 0, 0), (1, 1, 1), (1, -1, 2)], addresses)
    runs = [(x, y, out)]
    rt.submit(program).wait(30)
    for _ in range(2):
        runs.append(tensors())
        program.rebind(binding, np.array([t.data_ptr() for t in runs[-1]], dtype=np.uint64))
        rt.submit(program).wait(30).check()
    for x, y, out in runs:
        torch.testing.assert_close(out, torch.sigmoid(x[1:]) + y)


def test_uploads_reach_the_device_before_the_run_and_read_brings_its_results_back(
    rt: Runtime,
) -> None:
    """A program resubmitted with its inputs as uploads (host words written between runs, as
    the LLM engine writes a step's) computes on each run's words, and
    `read` returns each run's output to host memory the caller reuses."""
    pinned = rt.device.type == "cuda"
    host = torch.empty(4, 700, pin_memory=pinned)
    x = torch.empty(4, 700, device=rt.device)
    build = rt.program()
    out = build.add(OpCall("sigmoid", (build.add(OpCall("mul", (x, x))),)))
    program = build.build()
    back = torch.empty(4, 700, pin_memory=pinned).numpy()
    for seed in range(4):
        words = torch.randn(4, 700, generator=torch.Generator().manual_seed(seed))
        host.copy_(words)
        rt.submit(program, ((x, host),)).wait(30).check()
        rt.read(out, back)
        torch.testing.assert_close(torch.from_numpy(back), torch.sigmoid(words * words))


def test_a_programs_records_that_a_later_record_waits_for_are_published_through_it(
    rt: Runtime,
) -> None:
    """The host learns of a program's completion from its records' completions; only the records
    no later record waits for fence their outputs to system scope first, the others (TASK_LOCAL)
    are published through the completion of those that waited for them, and every result is
    complete when the program is."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 301, generator=gen).to(rt.device)
    build = rt.program()
    a = build.add(OpCall("relu", (x,)))  # 0: read by 1
    b = build.add(OpCall("mul", (a, a)))  # 1: read by 2
    build.add(OpCall("add", (b, x)))  # 2: the end of its chain
    build.add(OpCall("neg", (x,)))  # 3: waits for nothing, and nothing waits for it
    program = build.build()
    records, owners = program.tasks.records, program.tasks.owners
    tiles = program.tasks.op_of_record >= 0  # operator records, not joins
    local = [bool((records["flags"][tiles & (owners == i)] & TASK_LOCAL).all()) for i in range(4)]
    publish = [not (records["flags"][tiles & (owners == i)] & TASK_LOCAL).any() for i in range(4)]
    assert local[:2] == [True, True] and publish[2:] == [True, True]
    relu, square, total, negated = rt.submit(program).wait(30).results()
    torch.testing.assert_close(total, torch.relu(x) ** 2 + x)
    torch.testing.assert_close(negated, -x)
    torch.testing.assert_close(square, relu * relu)


def test_a_linear_reads_its_weight_before_its_wait_only_when_no_task_before_writes_it(
    rt: Runtime,
) -> None:
    """The linear streams its weights in while its x is produced (TASK_SETTLED): a weight that an
    earlier task of the program writes is read after the wait, so every answer is the weight's
    new value, run after run."""
    gen = torch.Generator().manual_seed(7)
    x0, w = (torch.randn(s, generator=gen).half().to(rt.device) for s in ((5, 264), (200, 264)))
    build = rt.program()
    x = build.add(OpCall("relu", (x0,)))  # 0
    w2 = build.add(OpCall("mul", (w, w)))  # 1
    build.add(OpCall("linear", (x, w2)))  # 2: its weight comes from task 1
    build.add(OpCall("linear", (x, w)))  # 3: its weight from no task
    program = build.build()
    flags = program.tasks.records["flags"]
    settled = [int(np.bitwise_or.reduce(flags[program.tasks.owners == i])) for i in (2, 3)]
    assert [(f & task_settled(0), f & task_settled(1)) for f in settled] == [
        (0, 0),
        (0, task_settled(1)),
    ]
    for scale in (1.0, -0.5):
        w.copy_(torch.randn(w.shape, generator=gen).half().to(rt.device) * scale)
        new, fresh = rt.submit(program).wait(30).results()[2:]
        ref = torch.relu(x0).float()
        torch.testing.assert_close(new.float(), ref @ (w.float() * w.float()).t(), **HALF)
        torch.testing.assert_close(fresh.float(), ref @ w.float().t(), **HALF)


def test_edges_follow_data_flow_and_drop_implied_ones() -> None:
    with Runtime("cpu") as rt:
        x = torch.randn(4, 8)
        build = rt.program()
        a = build.add(OpCall("relu", (x,)))  # 0
        b = build.add(OpCall("sigmoid", (a,)))  # 1: reads 0
        c = build.add(OpCall("tanh", (a,)))  # 2: reads 0
        d = build.add(OpCall("add", (b, c)))  # 3: diamond: 1 and 2
        build.add(OpCall("add", (d, a)))  # 4: reads 3 and 0; 0 implied by 3
        build.add(OpCall("neg", (x,), out=a))  # 5: overwrites a: after its readers 1, 2, 4
        build.add(OpCall("relu", (x,)), after=(0,))  # 6: only the explicit order
        program = build.build()
        assert program.deps == ((), (0,), (0,), (1, 2), (3,), (4,), (0,))
        rt.submit(program).wait(10)
        torch.testing.assert_close(a, -x)  # the overwrite ran after every reader of a


def test_edges_of_ranges_of_many_widths_in_one_storage() -> None:
    """Views of one buffer, as a program's activations share an arena: a read meets a wide
    write far from where that write starts, and a write that covers earlier accesses leaves
    later readers depending on it alone."""
    with Runtime("cpu") as rt:
        buf, x = torch.zeros(1000), torch.randn(1000)
        build = rt.program()
        build.add(OpCall("relu", (x,), out=buf))  # 0: writes all of buf
        build.add(OpCall("neg", (x[10:20],), out=buf[10:20]))  # 1: after 0
        build.add(OpCall("sigmoid", (buf[500:510],)))  # 2: meets 0 only
        build.add(OpCall("relu", (buf[15:18],)))  # 3: meets 0 and 1; 0 implied
        build.add(OpCall("neg", (x,), out=buf))  # 4: after the readers 2 and 3
        last = build.add(OpCall("tanh", (buf[990:],)))  # 5: 4 covered 0 and 1
        program = build.build()
        assert program.deps == ((), (0,), (0,), (1,), (2, 3), (4,))
        rt.submit(program).wait(10)
        torch.testing.assert_close(last, torch.tanh(-x[990:]))


def test_the_records_writing_a_tensor_are_those_of_its_last_writers() -> None:
    """A step plans a projection's splits around the blocks its input's producers hold: the
    records of the tasks last added that write it (a step's lanes, each a part of one output),
    not those of an earlier writer of the same memory."""
    with Runtime("cpu") as rt:
        rt.backend.tile_elements = 512
        x = torch.randn(64, 256)
        halves = (slice(0, 32), slice(32, 64))
        build = rt.program()
        out = build.empty((64, 256), torch.float32)
        build.add(OpCall("relu", (x,), out=out))  # an earlier writer
        build.add(OpCall("neg", (x,)))  # another tensor's
        for rows in halves:
            build.add(OpCall("sigmoid", (x[rows],), out=out[rows]))
        each = [len(rt.prepare(OpCall("sigmoid", (x[r],))).records) for r in halves]
        assert each[0] > 1
        assert build.records_writing(out) == sum(each)
        assert build.records_writing(out[:16]) == each[0]
        assert build.records_writing(x) == 0


def test_a_task_follows_the_writers_of_the_tensors_its_workspace_carries() -> None:
    """Attention reads its newest keys and values through its workspace, not its inputs: it
    still runs after the tasks that write them."""
    with Runtime("cpu") as rt:
        q, rows = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
        k = torch.randn(2, 1, 1, 5, 8)
        lengths = torch.tensor([3, 5], dtype=torch.int32).view(2, 1, 1)
        build = rt.program()
        new_k = build.add(OpCall("neg", (rows,)))  # 0
        new_v = build.add(OpCall("relu", (rows,)))  # 1
        out = build.add(OpCall("attention_decode", (q, k, k, lengths, new_k, new_v)))  # 2
        program = build.build()
        assert program.deps[2] == (0, 1)
        rt.submit(program).wait(10)
        full_k, full_v = k.clone(), k.clone()
        for b, n in enumerate((3, 5)):
            full_k[b, :, :, n - 1], full_v[b, :, :, n - 1] = -rows[b], rows[b].relu()
        want = [
            torch.softmax(full_k[b, 0, 0, :n] @ q[b, 0, 0] / 8**0.5, 0) @ full_v[b, 0, 0, :n]
            for b, n in enumerate((3, 5))
        ]
        torch.testing.assert_close(out[:, 0, 0], torch.stack(want))


def test_a_task_with_more_producers_than_waits_gets_join_records(rt: Runtime) -> None:
    x = torch.randn(64, 64).to(rt.device)
    build = rt.program()
    parts = [build.add(OpCall("mul", (x, torch.full_like(x, float(k))))) for k in range(5)]
    build.add(OpCall("neg", (x,), out=x))  # writes x after all five readers: five producers
    s = build.add(OpCall("add", (parts[0], parts[1])))
    s2 = build.add(OpCall("add", (parts[2], parts[3])))
    last = build.add(OpCall("add", (s, s2)))
    program = build.build()
    assert program.joins == 3 and len(program.deps[5]) == 5
    ref = x.clone()
    rt.submit(program).wait(30)
    torch.testing.assert_close(x, -ref)
    torch.testing.assert_close(last, ref * 6)


def test_a_program_ten_times_the_ring_runs_as_space_frees(backend: str) -> None:
    with runtime(backend, capacity=64, publish_chunk=16) as rt:
        x = torch.randn(1000).to(rt.device)
        build = rt.program()
        y = x
        for _k in range(700):  # a dependent chain: every record waits for the one before it
            y = build.add(OpCall("add", (y, x)))
        program = build.build()
        for _ in range(2):
            rt.submit(program).wait(60)
            torch.testing.assert_close(y, x * 701, rtol=1e-4, atol=1e-3)


def test_waits_survive_the_worker_lease_ending_mid_program(backend: str) -> None:
    with runtime(backend, lease_ms=1, idle_us=50) as rt:
        x = torch.randn(256, 256).to(rt.device)
        build = rt.program()
        rows = [build.add(OpCall("softmax", (x,)))]
        for _ in range(400):
            rows.append(build.add(OpCall("add", (rows[-1], x))))
        rt.submit(build.build()).wait(60)
        torch.testing.assert_close(rows[-1], torch.softmax(x, -1) + 400 * x, rtol=1e-4, atol=1e-3)


def test_eight_threads_submit_programs_and_plain_batches_at_once(rt: Runtime) -> None:
    errors: list[str] = []

    def client(k: int) -> None:
        x = torch.full((33, 77), float(k)).to(rt.device)
        build = rt.program()
        y = x
        for _ in range(30):
            y = build.add(OpCall("add", (y, x)))
        program = build.build()
        for _ in range(5):
            rt.submit(program)
            plain = rt.submit([rt.prepare(OpCall("mul", (x, x))) for _ in range(4)]).wait(60)
            rt.submit(program).wait(60)  # waits for the run before it first
            if not torch.equal(y, x * 31) or not all(
                torch.equal(o, x * x) for o in plain.results()
            ):
                errors.append(f"thread {k}: wrong result")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_swap_and_rollback_take_effect_at_the_next_run(rt: Runtime) -> None:
    rt.register("prog_affine", "A * 2 + 1")
    x = torch.randn(500).to(rt.device)
    build = rt.program()
    y = build.add(OpCall("prog_affine", (x,)))
    z = build.add(OpCall("add", (y, y)))
    program = build.build()
    runs = []
    for change in (
        None,
        lambda: rt.swap("prog_affine", "A * 3"),
        lambda: rt.rollback("prog_affine"),
    ):
        if change:
            change()
        runs.append((rt.submit(program).wait(30).versions[0], z.clone()))
    assert [v for v, _ in runs] == [1, 2, 1]
    torch.testing.assert_close(runs[0][1], 2 * (2 * x + 1))
    torch.testing.assert_close(runs[1][1], 2 * (3 * x))
    torch.testing.assert_close(runs[2][1], 2 * (2 * x + 1))


def test_bad_programs_are_refused_with_what_to_fix() -> None:
    with Runtime("cpu") as rt:
        build = rt.program()
        with pytest.raises(ProgramError, match="at least one task"):
            build.build()
        with pytest.raises(ProgramError, match=r"after=\[0\] must name earlier tasks"):
            build.add(OpCall("relu", (torch.ones(3),)), after=(0,))


def test_the_cpu_backend_fails_a_record_whose_wait_can_never_be_met() -> None:
    with Runtime("cpu") as rt:
        task = rt.prepare(OpCall("relu", (torch.ones(4),)))
        records = task.records.copy()
        records["wait"][:, 0], records["wait_count"][:, 0] = 0, 1  # an event nothing signals
        owners = np.zeros(1, dtype=np.int32)
        listed = TaskList((task,), records, owners, (task.op,), owners, owners)
        with pytest.raises(TaskFailedError, match="producers must precede"):
            rt.submit(listed).wait(10).result(0)
