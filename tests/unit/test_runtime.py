"""The runtime API on the CPU backend: batches, waiting, registering, swapping and rolling back
operators (with real NVRTC compiles of each new version), typed errors."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from gpuos_core import (
    CompileError,
    ExpressionError,
    OpCall,
    OperatorExistsError,
    RawCudaDisabledError,
    RollbackError,
    Runtime,
    RuntimeClosedError,
    TaskFailedError,
    TensorSpecError,
    UnknownOperatorError,
)
from gpuos_core.backends.cpu import CpuBackend
from gpuos_core.batch import Batch
from gpuos_core.catalogue import CATALOGUE
from gpuos_core.optable import Image, OpVersion
from gpuos_core.runtime import RuntimeConfig, encode_records


@pytest.fixture
def rt(backend: str) -> Runtime:
    with Runtime(backend) as runtime:
        yield runtime


@pytest.fixture
def cpu_rt() -> Runtime:
    with Runtime("cpu") as runtime:
        yield runtime


def test_auto_picks_cpu_without_a_gpu_and_says_why(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with Runtime(config=RuntimeConfig(backend="auto", cache_dir=tmp_path)) as runtime:
        assert runtime.backend_name == "cpu"
        assert "auto" in runtime.backend_reason and "cpu" in runtime.backend_reason


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        Runtime("tpu")


def test_register_expression_operator_and_run_it(rt: Runtime) -> None:
    made = rt.register("fma", "A * B + C")
    assert (made.name, made.version, made.spec.arity) == ("fma", 1, 3)
    a, b, c = (torch.randn(4, 5, device=rt.device) for _ in range(3))
    torch.testing.assert_close(rt.run("fma", a, b, c), a * b + c)


def test_registered_scalars_are_named_and_required(rt: Runtime) -> None:
    rt.register("affine", "A * s0 + s1")
    x = torch.randn(7, device=rt.device)
    torch.testing.assert_close(rt.run("affine", x, s0=2.0, s1=-1.0), x * 2 - 1)
    with pytest.raises(TensorSpecError, match="needs the parameter 's1'"):
        rt.run("affine", x, s0=2.0)


def test_swap_then_rollback_changes_what_new_tasks_compute(rt: Runtime) -> None:
    x = torch.randn(64, device=rt.device)
    v2 = rt.swap("relu", "max(A, 0) * 2")
    assert v2.version == 2 and rt.table.previous("relu").version == 1
    torch.testing.assert_close(rt.run("relu", x), torch.relu(x) * 2)
    generation = rt.generation
    back = rt.rollback("relu")
    assert back.version == 1
    assert rt.generation == generation  # dual slot: an alias flip, no new image
    torch.testing.assert_close(rt.run("relu", x), torch.relu(x))
    assert [v.version for v in rt.history("relu")] == [1, 2]


def test_tasks_keep_the_version_active_when_submitted(rt: Runtime) -> None:
    rt.register("scale", "A * 3")
    x = torch.randn(32, device=rt.device)
    before = rt.submit([rt.prepare(OpCall("scale", (x,)))])
    rt.swap("scale", "A * 5")
    after = rt.submit([rt.prepare(OpCall("scale", (x,)))])
    assert before.wait(10).versions == (1,) and after.wait(10).versions == (2,)
    torch.testing.assert_close(before.result(0), x * 3)
    torch.testing.assert_close(after.result(0), x * 5)


def test_rolling_back_twice_reaches_the_first_version_through_a_new_image(rt: Runtime) -> None:
    rt.register("k", "A + 1")
    rt.swap("k", "A + 2")
    rt.swap("k", "A + 3")
    x = torch.randn(8, device=rt.device)
    assert rt.rollback("k").version == 2
    generation = rt.generation
    assert rt.rollback("k").version == 1
    assert rt.generation == generation + 1  # v1 was no longer loaded
    torch.testing.assert_close(rt.run("k", x), x + 1)
    with pytest.raises(RollbackError, match="nothing to roll back to"):
        rt.rollback("k")


def test_swap_under_concurrent_load_never_mixes_versions(rt: Runtime) -> None:
    rt.register("tag", "A + 1")
    expected = {1: 1.0}  # version → what it adds
    failures: list[str] = []
    stop = threading.Event()

    def load() -> None:
        x = torch.randn(256, device=rt.device)
        while not stop.is_set():
            batch = rt.submit([rt.prepare(OpCall("tag", (x,))) for _ in range(4)]).wait(10)
            for i, version in enumerate(batch.versions):
                if not torch.allclose(batch.result(i), x + expected[version]):
                    failures.append(f"v{version} gave a wrong result")

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for k in range(2, 6):
        expected[len(rt.history("tag")) + 1] = float(k)  # known before any task can use it
        rt.swap("tag", f"A + {k}")
        rt.rollback("tag")
    stop.set()
    for t in threads:
        t.join()
    assert not failures


def test_await_does_not_block_the_event_loop(rt: Runtime) -> None:
    async def main() -> list[torch.Tensor]:
        x = torch.randn(3, 3, device=rt.device)
        batches = [rt.submit([rt.prepare(OpCall("exp", (x,)))]) for _ in range(20)]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        done = await asyncio.gather(*batches)
        tick.cancel()
        assert ticks > 0
        return [b.result(0) for b in done]

    for out in asyncio.run(main()):
        assert out.shape == (3, 3)


def test_a_batch_nobody_waits_for_completes_and_calls_back(rt: Runtime) -> None:
    """Completions are reaped without a waiter (a chained step queued behind another), if on
    the poller's slower round, and a callback given meanwhile runs."""
    x = torch.randn(64, device=rt.device)
    batch = rt.submit([rt.prepare(OpCall("exp", (x,)))])
    for _ in range(1000):
        if batch.done():
            break
        threading.Event().wait(0.001)
    assert batch.done()
    torch.testing.assert_close(batch.result(0), torch.exp(x))
    called = threading.Event()
    later = rt.submit([rt.prepare(OpCall("exp", (x,)))])
    later.add_done_callback(lambda b: called.set())
    assert called.wait(5) and later.done()


def test_bad_expression_is_rejected_with_its_position(rt: Runtime) -> None:
    with pytest.raises(ExpressionError) as info:
        rt.register("bad", "A * sigmod(B)")
    assert info.value.position == 4 and "sigmoid" in str(info.value)
    with pytest.raises(UnknownOperatorError):
        rt.run("bad", torch.randn(2, device=rt.device), torch.randn(2, device=rt.device))


def test_bad_tensor_inputs_are_typed_errors(rt: Runtime) -> None:
    with pytest.raises(TensorSpecError, match="takes 2 tensor input"):
        rt.run("add", torch.randn(3, device=rt.device))
    with pytest.raises(TensorSpecError, match="do not broadcast"):
        rt.run("add", torch.randn(3, device=rt.device), torch.randn(4, device=rt.device))
    with pytest.raises(TensorSpecError, match="float64"):
        rt.run("relu", torch.randn(3, dtype=torch.float64, device=rt.device))
    with pytest.raises(TensorSpecError, match="shape"):
        rt.run("layernorm", torch.randn(4, 8, device=rt.device), torch.randn(7, device=rt.device))
    with pytest.raises(TensorSpecError, match="out must be"):
        rt.run("relu", torch.randn(3, device=rt.device), out=torch.empty(4, device=rt.device))
    with pytest.raises(TensorSpecError, match="no parameter"):
        rt.run("relu", torch.randn(3, device=rt.device), alpha=1.0)
    with pytest.raises(UnknownOperatorError, match="unknown operator 'nope'"):
        rt.run("nope", torch.randn(3, device=rt.device))


def test_register_and_swap_guard_their_inputs(rt: Runtime) -> None:
    with pytest.raises(OperatorExistsError, match="swap it"):
        rt.register("relu", "A")
    with pytest.raises(TensorSpecError, match="only elementwise"):
        rt.swap("softmax", "A")
    with pytest.raises(ExpressionError, match="beyond the operator.s 1 input"):
        rt.swap("relu", "A + B")
    with pytest.raises(TensorSpecError, match="name"):
        rt.register("Bad-Name", "A")


def test_one_failing_task_fails_only_itself(cpu_rt: Runtime) -> None:
    backend = CpuBackend()
    backend.load(Image(1, (OpVersion(CATALOGUE["relu"], 1),)), None)
    rt_tasks = [cpu_rt.prepare(OpCall("relu", (torch.randn(5),))) for _ in range(3)]
    records = np.concatenate([t.records for t in rt_tasks])
    records["op_slot"] = [0, 7, 0]  # no slot 7 in the loaded image
    batch = Batch(rt_tasks, records, np.arange(3), [1, 1, 1])
    backend.launch(batch)
    batch.wait(10)
    backend.close()
    torch.testing.assert_close(batch.result(0), torch.relu(rt_tasks[0].inputs[0]))
    torch.testing.assert_close(batch.result(2), torch.relu(rt_tasks[2].inputs[0]))
    with pytest.raises(TaskFailedError):
        batch.result(1)
    with pytest.raises(TaskFailedError):  # check() names the first failed task too
        batch.check()


def test_a_task_writes_only_its_range_of_work_items(cpu_rt: Runtime) -> None:
    backend = CpuBackend()
    backend.load(
        Image(1, (OpVersion(CATALOGUE["neg"], 1), OpVersion(CATALOGUE["softmax"], 1))), None
    )
    elem = cpu_rt.prepare(OpCall("neg", (torch.randn(4, 6).t(),), out=torch.zeros(6, 4)))
    rows = cpu_rt.prepare(OpCall("softmax", (torch.randn(5, 3),), out=torch.zeros(5, 3)))
    records = np.concatenate([elem.records, rows.records])
    records["op_slot"] = [0, 1]
    records["range_begin"], records["range_end"] = (5, 1), (11, 3)  # a tile of each
    batch = Batch([elem, rows], records, np.arange(2), [1, 1])
    backend.launch(batch)
    batch.wait(10)
    backend.close()
    want = torch.zeros(24)
    want[5:11] = -elem.inputs[0].reshape(-1)[5:11]
    torch.testing.assert_close(elem.out.reshape(-1), want)
    torch.testing.assert_close(rows.out[1:3], torch.softmax(rows.inputs[0][1:3], -1))
    assert (rows.out[[0, 3, 4]] == 0).all()


def test_tiles_cover_every_work_item_once(cpu_rt: Runtime) -> None:
    task = cpu_rt.prepare(OpCall("softmax", (torch.randn(10, 300),)))
    records = encode_records(task, tile_elements=1000)  # 3 rows of 300 per tile
    assert list(zip(records["range_begin"], records["range_end"])) == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 10),
    ]
    assert (records["out"]["data"] == task.out.data_ptr()).all()
    assert len(encode_records(task, tile_elements=None)) == 1


def test_rows_spread_over_the_sms_take_one_wave_of_records(cpu_rt: Runtime) -> None:
    """512 rows of 768 (a prefill step's norm) on 132 SMs: 128 records of 4 rows, one wave, where
    rounding down made 171 of 3 (two waves); 64 rows keep a record each. (Off a GPU, plans
    assume 132 SMs: families.DEFAULT_SMS.)"""
    for rows, want in ((512, [4] * 128), (64, [1] * 64)):
        task = cpu_rt.prepare(OpCall("softmax", (torch.randn(rows, 768),)))
        records = encode_records(task, tile_elements=16384)
        sizes = (records["range_end"] - records["range_begin"]).tolist()
        assert sizes == want


def test_closed_runtime_refuses_work(tmp_path) -> None:
    runtime = Runtime(config=RuntimeConfig(backend="cpu", cache_dir=tmp_path))
    runtime.close()
    with pytest.raises(RuntimeClosedError):
        runtime.run("relu", torch.randn(2))


def raw_cuda_runtime(backend: str) -> Runtime:
    return Runtime(config=RuntimeConfig(backend=backend, allow_raw_cuda=True))


def test_raw_cuda_needs_the_configuration_to_allow_it(rt: Runtime) -> None:
    with pytest.raises(RawCudaDisabledError, match="allow_raw_cuda"):
        rt.register("triple", "A * 3", cuda="return a[0] * 3.0f;")


def test_raw_cuda_operator_serves_with_its_expression_as_reference(backend: str) -> None:
    with raw_cuda_runtime(backend) as rt:
        rt.register("triple", "A * 3", cuda="return a[0] * 3.0f;")
        x = torch.randn(300, device=rt.device)
        torch.testing.assert_close(rt.run("triple", x), x * 3)


def test_raw_cuda_that_does_not_compile_is_refused_and_the_old_version_serves(backend: str) -> None:
    with raw_cuda_runtime(backend) as rt:
        rt.register("twice", "A * 2")
        with pytest.raises(CompileError) as info:
            rt.swap("twice", "A * 2", cuda="return a[0] * undefined_name;")
        assert "undefined_name" in info.value.log
        assert rt.table.current("twice").version == 1
        x = torch.randn(16, device=rt.device)
        torch.testing.assert_close(rt.run("twice", x), x * 2)
