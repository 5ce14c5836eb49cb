"""The continuous-batching engine: its logits equal the reference forward (and transformers') for
GPT-2 and Llama configs with ragged prompts decoded together, on the runtime (CPU backend here, CUDA
where there is one) and with torch micro-ops; sampling, stop strings, max_tokens, bounded KV slots,
queueing and errors."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuos_core import CudaConfig, Runtime
from gpuos_core.families import sm_count
from gpuos_core.program import Arena
from serving.llm import ByteTokenizer, Model, create_tiny_model, forward_tokens, load_model
from serving.llm.device_step import (
    GROUP_ROWS,
    LANE_ROWS,
    Layout,
    StepChain,
    StepProgram,
    StepWork,
    fusable,
    head_cuts,
    lanes_of,
)
from serving.llm.engine import (
    Delta,
    Engine,
    EngineConfig,
    EngineFullError,
    KVMemoryError,
    PromptTooLongError,
    _ProgramForward,
)
from serving.llm.forward import Span
from serving.llm.model import KVPool, rotary_tables
from serving.llm.sampling import SamplingParams

FAMILIES = ["gpt2", "llama"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(
        tmp_path_factory.mktemp(request.param) / "model", request.param, seed=3
    )


@pytest.fixture(scope="module")
def runtime(backend: str) -> Iterator[Runtime]:
    with Runtime(backend) as rt:
        yield rt


def device_model(model_dir: Path, runtime: Runtime, dtype: torch.dtype = torch.float32) -> Model:
    return load_model(model_dir, dtype=dtype, device=str(runtime.device))


def start(model: Model, runtime: Runtime | None, **config: object) -> Engine:
    return Engine(model, ByteTokenizer(eos_id=None), runtime, EngineConfig(**config))


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


def run_together(
    engine: Engine, batch: list[list[int]], params: SamplingParams
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Submit every prompt at once (they share steps); each one's generated ids and logits."""
    streams = [engine.submit(p, params, keep_logits=True) for p in batch]
    finals = [list(s)[-1] for s in streams]
    assert all(f.error is None for f in finals), finals
    assert all(s.tokens == [int(t.argmax()) for t in s.logits] for s in streams)  # greedy
    return [(s.tokens, s.logits) for s in streams]


def reference_logits(model: Model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Rows of one full forward that predict each generated token."""
    sequence = torch.tensor(prompt + generated[:-1], device=model.weights.embed.device)
    return forward_tokens(model, sequence)[len(prompt) - 1 :].float().cpu()


def assert_last_row_logits(model: Model, prompt: list[int], row: torch.Tensor) -> None:
    """`row` is the reference forward's logits of `prompt`'s last token."""
    tokens = torch.tensor(prompt, device=model.weights.embed.device)
    want = forward_tokens(model, tokens)[-1].float().cpu()
    torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("micro_ops", ["runtime", "torch"])
def test_engine_logits_equal_the_reference_forward(
    model_dir: Path, runtime: Runtime, micro_ops: str
) -> None:
    model = device_model(model_dir, runtime)
    config = {"micro_ops": micro_ops, "max_running": 4, "max_step_tokens": 24, "decode_steps": 4}
    engine = start(model, runtime, **config)
    try:
        batch = prompts([5, 17, 1, 30, 9])  # ragged; 30 is chunked over two steps
        for prompt, (generated, logits) in zip(batch, run_together(engine, batch, GREEDY)):
            assert len(generated) == GREEDY.max_tokens
            expected = reference_logits(model, prompt, generated)
            torch.testing.assert_close(torch.stack(logits), expected, rtol=1e-4, atol=1e-4)
        if micro_ops == "runtime":  # the decode steps ran four to a program
            assert engine.stats()["launches"] < engine.stats()["steps"]
    finally:
        engine.close()


def test_engine_logits_in_bf16(model_dir: Path, runtime: Runtime) -> None:
    model = device_model(model_dir, runtime, torch.bfloat16)
    engine = start(model, runtime)
    try:
        batch = prompts([4, 11], seed=1)
        for prompt, (generated, logits) in zip(batch, run_together(engine, batch, GREEDY)):
            expected = reference_logits(model, prompt, generated)
            torch.testing.assert_close(torch.stack(logits), expected, rtol=0.05, atol=0.1)
    finally:
        engine.close()


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="Hugging Face `transformers` is not installed (optional)",
)
def test_engine_logits_equal_transformers(model_dir: Path, runtime: Runtime) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32
    ).eval()
    engine = start(device_model(model_dir, runtime), runtime)
    try:
        batch = prompts([3, 12], seed=2)
        for prompt, (generated, logits) in zip(batch, run_together(engine, batch, GREEDY)):
            with torch.no_grad():
                expected = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(torch.stack(logits), expected, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def test_decode_rows_in_lanes_give_the_reference_logits(model_dir: Path, runtime: Runtime) -> None:
    """A decode step of 2 LANE_ROWS rows runs as two lanes (each operator once per half of its
    rows, interleaved): every request's logits still equal the reference forward's."""
    rows = 2 * LANE_ROWS
    model = device_model(model_dir, runtime)
    assert len(lanes_of(Layout(rows, 0), model, sm_count(runtime.device))) == 2
    engine = start(model, runtime, max_running=rows, max_step_tokens=4 * rows)
    try:
        batch = prompts([1 + i % 7 for i in range(rows)], seed=5)
        for prompt, (generated, logits) in zip(batch, run_together(engine, batch, GREEDY)):
            expected = reference_logits(model, prompt, generated)
            torch.testing.assert_close(torch.stack(logits), expected, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def test_a_step_runs_in_one_lane_where_lanes_would_crowd_the_worker(model_dir: Path) -> None:
    """Lanes only where each lane's widest linear still has a block per tile, each lane has
    LANE_ROWS rows, and the step has no prefill span: otherwise a step is one lane."""
    model = load_model(model_dir)
    rows = 2 * LANE_ROWS
    assert lanes_of(Layout(rows, 0), model, 132) == (slice(0, LANE_ROWS), slice(LANE_ROWS, rows))
    assert lanes_of(Layout(rows, 0), model, 1) == (slice(0, rows),)
    assert lanes_of(Layout(rows - 1, 0), model, 132) == (slice(0, rows - 1),)
    assert lanes_of(Layout(rows, 1), model, 132) == (slice(0, rows + GROUP_ROWS),)


def test_a_small_vocabularys_head_runs_in_cuts_of_lane_rows() -> None:
    """The LM head of a vocabulary of a few tiles runs as tasks of LANE_ROWS rows or more, as
    many as still find a block per tile; a vocabulary that fills the worker is one task."""
    rows = 4 * LANE_ROWS
    quarters = tuple(slice(i * LANE_ROWS, (i + 1) * LANE_ROWS) for i in range(4))
    assert head_cuts(rows, 256, 132) == quarters
    assert head_cuts(rows, 256, 8) == (slice(0, 2 * LANE_ROWS), slice(2 * LANE_ROWS, rows))
    assert head_cuts(rows, 50257, 132) == (slice(0, rows),)
    assert head_cuts(2 * LANE_ROWS - 1, 256, 132) == (slice(0, 2 * LANE_ROWS - 1),)


def test_norms_of_lanes_of_32_rows_share_the_machine(model_dir: Path, runtime: Runtime) -> None:
    """A 64-row decode step (two lanes of 32 rows) records its residual norms as sharing the
    machine, so that they hold fewer blocks (AddNormFamily.cut); a step of lanes of 16 rows,
    or of one lane, records them with the machine their own."""
    model = device_model(model_dir, runtime)
    pool = KVPool.allocate(model.config, 64, 32, model.dtype, runtime.device)

    def shares(rows: int) -> set[int | None]:
        layout = Layout(rows, 0)
        chain = StepChain(layout.picks, 1, runtime.device)
        tables = rotary_tables(model, 32)
        step = StepProgram(
            runtime, model, pool, layout, tables, chain, 0, Arena(runtime.device), frozenset()
        )
        tasks = step.program.tasks
        norms = [tasks.op_names.index(op) for op in tasks.op_names if op.startswith("add_")]
        return {t.share for t, op in zip(tasks.tasks, tasks.op_of_task) if op in norms}

    assert lanes_of(Layout(64, 0), model, sm_count(runtime.device)) == (slice(0, 32), slice(32, 64))
    assert shares(64) == {2}
    assert shares(32) == {None}
    assert shares(8) == {None}


def test_a_prefill_steps_chunks_attend_in_one_wave_of_records(
    model_dir: Path, runtime: Runtime
) -> None:
    """A step of 32 chunks records a layer's attention as 32 tasks side by side (a chunk reads
    its own slot's keys): cut for their share of the machine, a layer's take a record per SM at
    most in all, not waves of records whose claims a block pays one after another."""
    model, layout = device_model(model_dir, runtime), Layout(0, 32)
    pool = KVPool.allocate(model.config, 4, 64, model.dtype, runtime.device)
    chain = StepChain(layout.picks, 1, runtime.device)
    step = StepProgram(
        runtime,
        model,
        pool,
        layout,
        rotary_tables(model, 64),
        chain,
        0,
        Arena(runtime.device),
        frozenset(),
    )
    # records as the CUDA backend cuts them (the CPU backend runs a task as one)
    tasks, tile = step.program.tasks, CudaConfig().tile_elements
    records = np.array([len(t.kind.ranges(t, tile)) for t in tasks.tasks])
    attention = tasks.op_of_task == tasks.op_names.index("attention_decode")
    per_layer = records[attention].reshape(model.config.layers, -1)
    assert per_layer.shape[1] == layout.groups
    assert per_layer.sum(axis=1).max() <= sm_count(runtime.device)


def test_decode_programs_are_built_at_start(model_dir: Path, runtime: Runtime) -> None:
    """Every decode-only layout has its programs, of one step and of decode_steps, once the
    engine is up, so requests joining and leaving never hold the streams for a decode build:
    generating adds prefill programs only."""
    engine = start(device_model(model_dir, runtime), runtime, max_running=6, decode_steps=4)
    try:
        forward = engine._forward
        assert isinstance(forward, _ProgramForward)
        fused = fusable(runtime.table)
        decoding = {
            (Layout(rows, 0, steps), parity, fused)
            for rows in (1, 2, 4, 6)
            for steps in (1, 4)
            for parity in (0, 1)
        }
        assert set(forward._programs) == decoding
        run_together(engine, prompts([3, 9, 1, 5, 7, 4]), GREEDY)
        assert {key for key in forward._programs if not key[0].groups} == decoding
    finally:
        engine.close()


def test_a_swapped_activation_reaches_the_next_step(model_dir: Path, runtime: Runtime) -> None:
    """The MLP's activation swapped while the engine runs changes the next request's logits (a
    GELU runs inside its up projection only while it is the catalogue's), and the rollback
    brings them back."""
    model = device_model(model_dir, runtime)
    kind = model.config.activation
    name, swapped = ("swiglu", "sigmoid(A) * B") if kind == "silu_glu" else (kind, "A")
    engine = start(model, runtime, max_running=2)
    batch = prompts([7], seed=4)

    def first_logits() -> torch.Tensor:
        return run_together(engine, batch, GREEDY)[0][1][0]

    try:
        before = first_logits()
        runtime.swap(name, swapped)
        try:
            after = first_logits()
        finally:
            runtime.rollback(name)
        assert (after - before).abs().max() > 1e-2
        torch.testing.assert_close(first_logits(), before, rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engine(model_dir: Path, runtime: Runtime) -> Iterator[Engine]:
    engine = start(device_model(model_dir, runtime), runtime, max_running=2, max_waiting=8)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    ("steps", "layout"),
    [
        # one length in slots 2, 0 and 3: the third step on the first's program, rebound
        ([((2,), [6]), ((0,), [6]), ((3,), [6])], Layout(0, 1)),
        # other lengths in any order, one group each
        ([((0, 1), [5, 12]), ((2, 3), [11, 7]), ((1, 0), [6, 13])], Layout(0, 2)),
        # spans over three groups, and spans of one and two groups
        ([((1,), [40]), ((0,), [45]), ((3, 2), [2, 31])], Layout(0, 3)),
    ],
)
def test_prefill_programs_serve_their_layout_in_any_slot_and_order(
    model_dir: Path,
    runtime: Runtime,
    steps: list[tuple[tuple[int, ...], list[int]]],
    layout: Layout,
) -> None:
    """Prefill programs are keyed by their count of groups, not by the spans' slots, lengths or
    order: every step runs on one program per parity, and each span gives the reference
    forward's logits."""
    model = device_model(model_dir, runtime)
    engine = start(model, runtime, max_running=4)
    try:
        forward = engine._forward
        assert isinstance(forward, _ProgramForward)
        for seed, (slots, lengths) in enumerate(steps):
            batch = prompts(lengths, seed=seed)
            spans = [Span(slot, 0, tuple(p)) for slot, p in zip(slots, batch)]
            greedy = np.zeros((len(spans), 3), dtype=np.float32)
            rng = np.zeros((len(spans), 3), dtype=np.int32)
            work = StepWork(spans, [1] * len(spans), greedy, rng, keep_logits=True)
            logits = forward.start(work).result().logits
            assert logits is not None
            for row, prompt in zip(logits[:, 0], batch):
                assert_last_row_logits(model, prompt, row)
        assert [key[0] for key in forward._programs if key[0].groups] == [layout] * 2
        # what /v1/stats reports: the decode programs of the start, then one build per parity
        assert engine.stats()["programs"] == 2 * len(Layout.decoding(4, 1)) + 2
    finally:
        engine.close()


def test_the_least_recently_used_prefill_programs_go_and_decode_programs_stay(
    model_dir: Path, runtime: Runtime
) -> None:
    """Past PROGRAMS programs of layouts with prefill rows, the least recently used is dropped
    (and built again when met again); the decode programs built at start are never dropped."""
    model = device_model(model_dir, runtime)
    engine = start(model, runtime, max_running=4)
    try:
        forward = engine._forward
        assert isinstance(forward, _ProgramForward)
        decoding = set(forward._programs)
        forward.PROGRAMS = 2  # one layout's two parities
        greedy, rng = np.zeros((1, 3), dtype=np.float32), np.zeros((1, 3), dtype=np.int32)
        for length in (6, 40, 6):  # one group, three groups, one group again
            for _ in range(2):
                span = Span(0, 0, tuple(prompts([length])[0]))
                forward.start(StepWork([span], [1], greedy, rng, keep_logits=False)).result()
        prefill = {key[0] for key in forward._programs if key[0].groups}
        assert prefill == {Layout(0, 1)} and decoding <= set(forward._programs)
        assert engine.stats()["programs"] == len(decoding) + 6
    finally:
        engine.close()


def test_seed_makes_sampling_reproducible(engine: Engine) -> None:
    prompt = prompts([6])[0]
    streams = [
        engine.submit(prompt, SamplingParams(max_tokens=12, temperature=2.0, seed=s))
        for s in (11, 11, 12, 13, 14)
    ]
    ids = [(list(s), s.tokens)[1] for s in streams]
    assert ids[0] == ids[1] and len(ids[0]) == 12
    assert any(other != ids[0] for other in ids[2:])  # (the tiny model's distributions are peaked)


def test_decode_steps_run_together_give_what_single_steps_give(
    model_dir: Path, runtime: Runtime
) -> None:
    """Decode steps run four to a program choose the tokens that steps run one at a time do:
    seeded draws, a stop string met inside a program (the tokens chosen past it dropped, not
    counted), max_tokens that is no multiple of four (a row runs only the steps its request has
    tokens left for); with fewer programs launched."""
    model = device_model(model_dir, runtime)
    batch = prompts([5, 9, 3], seed=5)
    sampled = SamplingParams(max_tokens=11, temperature=1.5, seed=9)
    greedy = SamplingParams(max_tokens=13, temperature=0.0)

    def generate(steps: int) -> tuple[list[tuple[str, Delta, list[int]]], dict[str, int]]:
        engine = start(model, runtime, max_running=4, decode_steps=steps)
        try:
            full, _ = engine.generate(batch[0], greedy)
            stopped = SamplingParams(max_tokens=13, temperature=0.0, stop=[full[6:8]])
            streams = engine.submit_many(batch, sampled) + engine.submit_many(batch[:1], stopped)
            out = []
            for stream in streams:
                deltas = list(stream)
                out.append(("".join(d.text for d in deltas), deltas[-1], stream.tokens))
            return out, engine.stats()
        finally:
            engine.close()

    (one, one_stats), (four, four_stats) = generate(1), generate(4)
    assert one == four
    assert [last.finish_reason for _, last, _ in four] == ["length"] * 3 + ["stop"]
    assert all(last.completion_tokens == len(tokens) for _, last, tokens in four)
    assert four_stats["launches"] < one_stats["launches"]
    assert four_stats["launches"] < four_stats["steps"]
    assert four_stats["tokens"] == one_stats["tokens"]


def test_a_waiting_request_keeps_decode_steps_one_at_a_time(
    model_dir: Path, runtime: Runtime
) -> None:
    """While a request waits for a slot, the running ones decode one step a program, so that it
    takes the first slot freed rather than up to decode_steps later; alone, each request's
    decode steps run four to a program."""
    model = device_model(model_dir, runtime)
    first, second = prompts([5, 7], seed=3)
    params = SamplingParams(max_tokens=13, temperature=0.0)

    def launches(together: bool) -> int:
        engine = start(model, runtime, max_running=1, decode_steps=4)
        try:
            if together:  # the second waits for the first's slot
                for stream in engine.submit_many([first, second], params):
                    assert list(stream)[-1].completion_tokens == 13
            else:
                for prompt in (first, second):
                    assert list(engine.submit(prompt, params))[-1].completion_tokens == 13
            return engine.stats()["launches"]
        finally:
            engine.close()

    # the first request's 12 decode steps: 12 programs while the second waits, 3 alone
    assert launches(together=True) - launches(together=False) == 9


def test_max_tokens_finishes_with_length(engine: Engine) -> None:
    text, last = engine.generate(prompts([5])[0], SamplingParams(max_tokens=7, temperature=0.0))
    assert last.finish_reason == "length" and last.completion_tokens == 7
    assert last.prompt_tokens == 5


def test_stop_string_truncates_and_finishes_with_stop(engine: Engine) -> None:
    prompt = list(b"hello world")
    full, _ = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))
    stop = full[4:6]
    assert stop, f"the greedy completion {full!r} is too short to pick a stop string from"
    text, last = engine.generate(
        prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])
    )
    assert last.finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_more_requests_than_slots_queue_and_all_finish(engine: Engine) -> None:
    peak = []
    streams = [engine.submit(p, GREEDY) for p in prompts([3, 8, 2, 5, 7], seed=4)]
    watcher = threading.Thread(
        target=lambda: [peak.append(engine.stats()["running"]) for _ in range(200)]
    )
    watcher.start()
    finals = [list(s)[-1] for s in streams]
    watcher.join()
    assert [f.finish_reason for f in finals] == ["length"] * 5
    assert max(peak) <= 2  # max_running bounds the KV slots in use


def test_streams_on_an_event_loop_get_every_delta_in_order(engine: Engine) -> None:
    """Deltas reach a loop's consumers in order (handed over once a step per loop), the same
    text as a thread's stream of the same greedy request; a consumer whose loop closed while its
    request ran costs the other requests nothing."""
    prompt, params = prompts([5], seed=7)[0], SamplingParams(max_tokens=12, temperature=0.0)

    async def consume() -> list[str]:
        stream = engine.submit(prompt, params, asyncio.get_running_loop())
        return [d.text async for d in stream]

    gone = asyncio.new_event_loop()
    engine.submit(prompt, params, gone)  # its loop closes before any delta is handed over
    gone.close()
    texts = asyncio.run(consume())
    threaded = list(engine.submit(prompt, params))
    assert "".join(texts) == "".join(d.text for d in threaded) and len(texts) > 1
    assert threaded[-1].finish_reason == "length" and threaded[-1].error is None


def test_a_request_not_incremental_gets_its_whole_text_in_one_delta(engine: Engine) -> None:
    """What a non-streamed API request asks for: the same text, counts and finish as the
    deltas of a streamed one, in a single delta at the end, on a loop or in a thread; a stop
    string still cuts it."""
    prompt = list(b"hello world")

    async def whole(params: SamplingParams) -> list[Delta]:
        loop = asyncio.get_running_loop()
        return [d async for d in engine.submit(prompt, params, loop, incremental=False)]

    for params in (
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[" "]),
    ):
        deltas = list(engine.submit(prompt, params))
        threaded = list(engine.submit(prompt, params, incremental=False))
        for got in (threaded, asyncio.run(whole(params))):
            assert len(got) == 1 and len(deltas) > 1
            assert got[0].text == "".join(d.text for d in deltas)
            assert got[0].finish_reason == deltas[-1].finish_reason
            assert got[0].completion_tokens == deltas[-1].completion_tokens


def test_full_queue_is_refused(model_dir: Path, runtime: Runtime) -> None:
    engine = start(device_model(model_dir, runtime), runtime, max_running=1, max_waiting=1)
    try:
        long = SamplingParams(max_tokens=60, temperature=0.0)
        streams = [engine.submit([1, 2, 3], long)]
        with pytest.raises(EngineFullError, match="retry"):
            for _ in range(3):  # one runs, one waits, the next is refused
                streams.append(engine.submit([1, 2, 3], long))
        for s in streams:
            s.cancel()
        assert {list(s)[-1].finish_reason for s in streams} <= {"cancelled", "length"}
    finally:
        engine.close()


def test_a_kv_pool_too_big_names_the_settings_to_lower(model_dir: Path, runtime: Runtime) -> None:
    model = device_model(model_dir, runtime)
    with pytest.raises(KVMemoryError, match="lower llm.max_running or llm.max_len"):
        start(model, runtime, micro_ops="torch", max_running=10**9)


@pytest.mark.parametrize("micro_ops", ["runtime", "torch"])
def test_requests_submitted_together_share_their_steps(
    model_dir: Path, runtime: Runtime, micro_ops: str
) -> None:
    """submit_many queues all or none, and the next step admits them together: four prompts of
    six greedy tokens take six steps (one prefill, five decode), not one set of steps each."""
    model = device_model(model_dir, runtime)
    engine = start(model, runtime, micro_ops=micro_ops, max_running=4, max_waiting=4)
    try:
        with pytest.raises(EngineFullError, match="5 more do not fit"):
            engine.submit_many(prompts([3, 5, 2, 7, 4]), GREEDY)
        assert engine.stats()["waiting"] == 0  # none of them was queued
        streams = engine.submit_many(prompts([3, 5, 2, 7]), GREEDY)
        assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 4
        assert engine.stats()["steps"] == GREEDY.max_tokens
    finally:
        engine.close()


@pytest.mark.parametrize("micro_ops", ["runtime", "torch"])
def test_stats_split_the_step_loop_into_host_and_wait(
    model_dir: Path, runtime: Runtime, micro_ops: str
) -> None:
    """stats() counts the step loop's milliseconds on the host and blocked on a launched step's
    tokens, within the wall time of the steps: the torch forward runs inside the loop (all
    host, no wait), a step program off it (on the CPU backend, slower than the loop: mostly
    wait; a GPU may finish it before the loop asks)."""
    model = device_model(model_dir, runtime)
    engine = start(model, runtime, micro_ops=micro_ops, max_running=2)
    try:
        began = time.perf_counter()
        streams = engine.submit_many(prompts([3, 5]), SamplingParams(max_tokens=24))
        assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 2
        wall_ms = 1000 * (time.perf_counter() - began)
        stats = engine.stats()
        assert stats["step_host_ms"] + stats["step_wait_ms"] <= wall_ms + 1  # each rounded
        if micro_ops == "torch":
            assert stats["step_wait_ms"] == 0 < stats["step_host_ms"]
        elif runtime.device.type == "cpu":
            assert stats["step_wait_ms"] > stats["step_host_ms"]
    finally:
        engine.close()


def test_context_limits(engine: Engine) -> None:
    with pytest.raises(PromptTooLongError, match="context holds"):
        engine.submit([1] * engine.max_len, GREEDY)
    with pytest.raises(PromptTooLongError, match="empty"):
        engine.submit([], GREEDY)
    with pytest.raises(PromptTooLongError, match="outside the vocabulary"):
        engine.submit([1, 999], GREEDY)
    _, last = engine.generate(
        [1] * (engine.max_len - 3), SamplingParams(max_tokens=50, temperature=0.0)
    )
    assert last.finish_reason == "length" and last.completion_tokens == 3
