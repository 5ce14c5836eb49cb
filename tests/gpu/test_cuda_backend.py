"""The CUDA backend's own guarantees: the leased worker co-runs with torch, expires and comes back,
the ring wraps and pushes back, large tasks are tiled, and a stalled worker raises."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpuos_core import (
    CanaryCrashError,
    CanaryMismatchError,
    CudaConfig,
    OpCall,
    Runtime,
    RuntimeConfig,
)
from gpuos_core.batch import Batch
from gpuos_core.errors import StalledWorkerError, TaskFailedError

pytestmark = pytest.mark.gpu


def cuda_runtime(**knobs: object) -> Runtime:
    return Runtime(config=RuntimeConfig(backend="cuda", cuda=CudaConfig(**knobs)))


@pytest.fixture(scope="module")
def rt() -> Runtime:
    with cuda_runtime() as runtime:
        yield runtime


def test_torch_work_and_device_syncs_interleave_with_runtime_traffic(rt: Runtime) -> None:
    errors: list[str] = []
    stop = threading.Event()

    def torch_work() -> None:
        a = torch.randn(2048, 2048, device="cuda")
        while not stop.is_set():
            b = a @ a
            del b
            torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # allocation churn
            torch.cuda.synchronize()  # device-wide: waits at most two leases

    worker = threading.Thread(target=torch_work)
    worker.start()
    try:
        x = torch.randn(4096, device="cuda")
        for _ in range(200):
            batch = rt.submit([rt.prepare(OpCall("mul", (x, x))) for _ in range(8)]).wait(30)
            if not all(torch.equal(out, x * x) for out in batch.results()):
                errors.append("wrong result")
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive(), "torch's thread did not finish: a sync waited on the worker"
    assert not errors


def test_the_worker_lease_expires_and_work_relaunches_it() -> None:
    with cuda_runtime(idle_us=100, lease_ms=2) as rt:
        x = torch.randn(1024, device="cuda")
        for _ in range(5):
            torch.testing.assert_close(rt.run("relu", x), torch.relu(x))
            time.sleep(0.01)  # far past idle_us: the worker has exited
        assert rt.backend.launches >= 5


def test_the_ring_wraps_and_pushes_back_without_losing_records() -> None:
    with cuda_runtime(capacity=64) as rt:
        x = torch.randn(777, device="cuda")
        batches = [
            rt.submit([rt.prepare(OpCall("add", (x, x))) for _ in range(40)]) for _ in range(25)
        ]  # 1000 records through 64 slots
        for batch in batches:
            assert all(torch.equal(out, x + x) for out in batch.wait(30).results())
        big = rt.submit([rt.prepare(OpCall("add", (x, x))) for _ in range(650)])  # 10x the ring
        assert all(torch.equal(out, x + x) for out in big.wait(30).results())


def test_a_record_the_image_lacks_fails_only_its_task_among_many(rt: Runtime) -> None:
    """The worker marks the record failed; the batch, whose last record succeeded, completes
    and says which task failed, and every other task holds its result."""
    xs = [torch.randn(64, device="cuda") for _ in range(300)]
    work = rt.encode([rt.prepare(OpCall("relu", (x,))) for x in xs])
    versions = rt.submit(work).wait(30).versions  # resolves the records' slots in place
    records = work.records.copy()
    records["op_slot"][150] = 1 << 20  # no such slot in the loaded image
    batch = Batch(work.tasks, records, work.owners, versions)
    rt.backend.launch(batch)
    batch.wait(30)
    with pytest.raises(TaskFailedError, match="not in the loaded image"):
        batch.result(150)
    for i in (0, 149, 151, 299):
        torch.testing.assert_close(batch.result(i), torch.relu(xs[i]))


def test_large_tasks_are_tiled_across_blocks(rt: Runtime) -> None:
    x = torch.randn(3_000_001, device="cuda", dtype=torch.float16)
    task = rt.prepare(OpCall("gelu", (x,)))
    assert len(task.records) > 100
    out = rt.submit([task]).wait(30).result(0)
    torch.testing.assert_close(
        out, torch.nn.functional.gelu(x.float()).half(), atol=2e-3, rtol=2e-3
    )
    rows = torch.randn(5000, 700, device="cuda")
    torch.testing.assert_close(rt.run("softmax", rows), torch.softmax(rows, -1))


def test_a_stalled_worker_raises_instead_of_hanging() -> None:
    config = RuntimeConfig(
        backend="cuda", allow_raw_cuda=True, cuda=CudaConfig(stall_timeout_s=0.02)
    )
    with Runtime(config=config) as rt:
        # one element whose operator spins ~0.2 s: one block, no completion for 10x the timeout
        spin = "const long long t = clock64(); while (clock64() - t < 400000000LL) {} return a[0];"
        rt.register("slow", "A", cuda=spin, canary=False)
        q = torch.randn(1, device="cuda")
        batch = rt.submit([rt.prepare(OpCall("slow", (q,)))])
        with pytest.raises(TaskFailedError, match="stalled"):
            batch.wait(60).result(0)
        with pytest.raises(StalledWorkerError):
            rt.run("relu", q)


def raw_cuda_runtime(**config: object) -> Runtime:
    return Runtime(config=RuntimeConfig(backend="cuda", allow_raw_cuda=True, **config))


def test_the_canary_rejects_a_faulting_operator_and_serving_goes_on() -> None:
    with raw_cuda_runtime() as rt:
        rt.register("safe", "A + 1")
        with pytest.raises(CanaryCrashError, match="faults"):
            rt.swap("safe", "A + 1", cuda="return *reinterpret_cast<volatile float*>(8) + a[0];")
        x = torch.randn(64, device="cuda")
        torch.testing.assert_close(rt.run("safe", x), x + 1)
        assert rt.table.current("safe").version == 1


def test_the_canary_rejects_a_hanging_operator() -> None:
    with raw_cuda_runtime(canary_timeout_s=25) as rt:
        rt.register("spin", "A")
        with pytest.raises(CanaryCrashError, match="hangs"):
            rt.swap("spin", "A", cuda="for (;;) __nanosleep(1000); return a[0];")
        x = torch.randn(8, device="cuda")
        torch.testing.assert_close(rt.run("spin", x), x)


def test_the_canary_rejects_a_mismatch_with_the_numbers() -> None:
    with raw_cuda_runtime() as rt:
        rt.register("scale3", "A * 3", cuda="return a[0] * 3.0f;")
        with pytest.raises(CanaryMismatchError) as info:
            rt.swap("scale3", "A * 3", cuda="return a[0] * 3.01f;")
        assert all(case["rel_error"] > 1e-3 for case in info.value.cases if not case["ok"])
        assert rt.table.current("scale3").version == 1


def test_a_batch_runs_after_torch_work_that_produced_its_inputs(rt: Runtime) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = (a @ a)[0]  # still being computed on torch's stream when submitted
        torch.testing.assert_close(rt.run("neg", x), -x)


def test_any_thread_may_submit(rt: Runtime) -> None:
    x = torch.randn(100, device="cuda")
    task = rt.prepare(OpCall("exp", (x,)))
    results: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: results.append(rt.submit([task]).wait(30).result(0)))
    thread.start()
    thread.join()
    torch.testing.assert_close(results[0], torch.exp(x))
