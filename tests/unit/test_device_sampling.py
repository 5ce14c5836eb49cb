"""sample_tokens on each backend: greedy rows equal torch.argmax, top_k=1 and a tiny top_p equal
greedy, a seeded row draws the same token alone or batched with other rows, draws follow the target
distribution (temperature, top-k, top-p) over many seeds, and each backend agrees with the torch
rule (gpuos_core.sampler, what the CPU backend runs) on many rows and vocabularies up to 128256;
plus Philox's known answers, the rng packing and the validation messages."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from test_catalogue import DTYPES

from gpuos_core import OpCall, Runtime
from gpuos_core.errors import TensorSpecError
from gpuos_core.families import family
from gpuos_core.sampler import philox4x32, rng_rows, sample_rows

VOCABS = [1, 2, 31, 1000, 50257, 128256]
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])


@pytest.fixture(scope="module")
def rt(backend: str) -> Runtime:
    with Runtime(backend) as runtime:
        if backend == "cpu":  # tile tasks here too, so records covering part of the rows run
            runtime.backend.tile_elements = 4096
        yield runtime


def logits_rows(
    rows: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool = False, masked: bool = False
) -> torch.Tensor:
    """Logits on the CPU: normal * 4, rounded to integers (many ties) or with some -inf tokens."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 4
    if ties:
        x = x.round()
    if masked:
        x[torch.rand(rows, vocab, generator=gen) < 0.3] = -math.inf
    return x.to(dtype)


def params_rows(rows: int, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    return torch.tensor([[temperature, top_p, float(top_k)]] * rows, dtype=torch.float32)


def sample(
    rt: Runtime, logits: torch.Tensor, params: torch.Tensor, rng: torch.Tensor
) -> torch.Tensor:
    """sample_tokens on the runtime's device; the token ids on the CPU."""
    call = OpCall("sample_tokens", tuple(t.to(rt.device) for t in (logits, params, rng)))
    return rt.submit([rt.prepare(call)]).wait(60).result(0).cpu()


def seeds(rows: int, first: int = 0, step: int = 0) -> torch.Tensor:
    return rng_rows([first + i for i in range(rows)], [step] * rows)


def test_philox_known_answers() -> None:
    """Random123's philox4x32-10 known-answer vectors (kat_vectors)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in cases:
        assert philox4x32(torch.tensor(counter), torch.tensor(key)).tolist() == list(want)


def test_rng_rows_packs_64_bit_seeds_as_int32_bits() -> None:
    rng = rng_rows([0, 2**64 - 1, 2**32 + 5], [7, 2**32 - 1, 0])
    assert rng.dtype == torch.int32 and rng.shape == (3, 3)
    words = (rng.long() & 0xFFFFFFFF).tolist()
    assert words == [[0, 0, 7], [2**32 - 1, 2**32 - 1, 2**32 - 1], [5, 1, 0]]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_equals_argmax(rt: Runtime, dtype: torch.dtype, vocab: int) -> None:
    rows = 4 if vocab > 10000 else 32
    for seed, (ties, masked) in enumerate([(False, False), (True, False), (True, True)]):
        logits = logits_rows(rows, vocab, dtype, seed, ties, masked)
        logits[0] = -math.inf  # no finite logit: index 0, as torch.argmax
        got = sample(rt, logits, params_rows(rows, 0.0, 0.9, 40), seeds(rows))
        assert got.dtype == torch.int32
        assert torch.equal(got, logits.argmax(dim=-1).int())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_k_one_and_tiny_top_p_are_greedy(rt: Runtime, dtype: torch.dtype) -> None:
    rows, vocab = 64, 256
    gen = torch.Generator().manual_seed(1)
    # distinct logits, exact in every dtype (8 significant bits): a permutation of k / 4
    logits = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]) / 4
    logits = logits.to(dtype)
    greedy = logits.argmax(dim=-1).int()
    for params in (
        params_rows(rows, 1.0, top_k=1),
        params_rows(rows, 1.5, top_p=1e-6),
        params_rows(rows, 0.7, top_p=0.0, top_k=50),
    ):
        assert torch.equal(sample(rt, logits, params, seeds(rows, step=3)), greedy)


def test_seeded_rows_draw_the_same_alone_and_batched(rt: Runtime) -> None:
    rows, vocab = 24, 1000
    logits = logits_rows(rows, vocab, torch.float32, 2) / 4
    params = torch.tensor(
        [[1.0, 1.0, 0.0], [0.8, 0.9, 0.0], [1.2, 1.0, 20.0], [0.7, 0.95, 50.0]] * (rows // 4),
        dtype=torch.float32,
    )
    rng = seeds(rows, first=1000, step=5)
    batched = sample(rt, logits, params, rng)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample(rt, logits[perm], params[perm], rng[perm]), batched[perm])
    alone = [sample(rt, logits[i : i + 1], params[i : i + 1], rng[i : i + 1]) for i in range(rows)]
    assert torch.equal(torch.cat(alone), batched)
    tasks = [
        rt.prepare(
            OpCall("sample_tokens", tuple(t[i].to(rt.device) for t in (logits, params, rng)))
        )
        for i in range(rows)
    ]  # one task per request, one submission
    together = [int(t) for t in rt.submit(tasks).wait(60).results()]
    assert together == batched.tolist()


def test_seed_and_step_move_the_draw(rt: Runtime) -> None:
    rows, vocab = 256, 64
    flat = torch.zeros(rows, vocab)
    params = params_rows(rows, 1.0)
    by_seed = sample(rt, flat, params, seeds(rows))
    by_step = sample(rt, flat, params, rng_rows([7] * rows, list(range(rows))))
    for draws in (by_seed, by_step):  # 256 uniform draws over 64 tokens hit most of them
        assert len(set(draws.tolist())) > 40


def expected_frequencies(temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The target distribution over PROBS's tokens, computed directly: p^(1/T), top-k, top-p."""
    q = PROBS ** (1 / temperature)
    q /= q.sum()
    if top_k:
        q[np.argsort(-q)[top_k:]] = 0
        q /= q.sum()
    order = np.argsort(-q)
    crossing = int(np.searchsorted(np.cumsum(q[order]), top_p - 1e-12))
    q[order[crossing + 1 :]] = 0
    return q / q.sum()


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 1.0, 2), (1.0, 0.8, 0), (2.0, 0.9, 3)],
)
def test_draws_follow_the_distribution(
    rt: Runtime, temperature: float, top_p: float, top_k: int
) -> None:
    draws = 20000
    logits = torch.tensor(np.log(PROBS), dtype=torch.float32).expand(draws, -1)
    tokens = sample(
        rt, logits, params_rows(draws, temperature, top_p, top_k), seeds(draws, first=12345)
    )
    freq = np.bincount(tokens.numpy(), minlength=len(PROBS)) / draws
    want = expected_frequencies(temperature, top_p, top_k)
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), f"{freq} vs {want}"


def mixed_params(rows: int, seed: int) -> torch.Tensor:
    """Per-row parameters of every kind, greedy rows among them."""
    gen = torch.Generator().manual_seed(seed)

    def pick(values: list[float]) -> torch.Tensor:
        return torch.tensor(values)[torch.randint(len(values), (rows,), generator=gen)]

    return torch.stack(
        (
            pick([0.0, 0.3, 0.7, 1.0, 1.5]),
            pick([1.0, 1.0, 0.95, 0.8, 0.3]),
            pick([0.0, 0.0, 1.0, 2.0, 10.0, 100.0, 5000.0]),
        ),
        dim=-1,
    ).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_the_torch_rule_on_many_rows(rt: Runtime, dtype: torch.dtype) -> None:
    """Exact on the CPU backend; on a GPU a token may differ only where masses or noisy keys tie
    within float rounding: at most one row in 500."""
    mismatches, total = 0, 0
    for seed, (rows, vocab, ties, masked) in enumerate(
        [(512, 2000, False, False), (512, 2000, True, True), (8, 128256, False, False)]
    ):
        logits = logits_rows(rows, vocab, dtype, seed, ties, masked) / (1 + seed)
        params, rng = mixed_params(rows, seed), seeds(rows, first=seed << 40, step=seed)
        got = sample(rt, logits, params, rng)
        mismatches += int((got != sample_rows(logits, params, rng)).sum())
        total += rows
    assert mismatches <= (0 if rt.backend.name == "cpu" else total // 500), mismatches


def test_leading_dims_broadcast_parameters_and_given_out(rt: Runtime) -> None:
    logits = logits_rows(6, 300, torch.float16, 5).view(2, 3, 300)
    params = torch.tensor([0.9, 0.9, 30.0])  # one row of parameters for every row of logits
    rng = seeds(6, first=99).view(2, 3, 3)
    want = sample_rows(logits.view(6, 300), params.expand(6, 3), rng.view(6, 3)).view(2, 3)
    out = torch.full((2, 5), -1, dtype=torch.int32, device=rt.device)
    call = OpCall(
        "sample_tokens", tuple(t.to(rt.device) for t in (logits, params, rng)), out=out[:, 1:4]
    )
    rt.submit([rt.prepare(call)]).wait(60)
    assert torch.equal(out[:, 1:4].cpu(), want)
    assert (out[:, 0] == -1).all() and (out[:, 4] == -1).all()  # nothing written around it
    assert sample(rt, logits[0, 0], params, rng[0, 0]).shape == ()  # one row: a 0-dim token


def test_rows_take_a_record_each_up_to_the_multiprocessors() -> None:
    """A step's rows are sampled side by side, whatever the vocabulary: a record per row up to
    the SMs (132 off a GPU), then rows spread evenly over as few records as take no more rows
    each; cut by elements, 8 rows of 256 logits were 2 records that sampled 4 rows one after
    the other."""

    def cut(rows: int, vocab: int) -> list[int]:
        with Runtime("cpu") as runtime:
            call = OpCall(
                "sample_tokens", (torch.zeros(rows, vocab), params_rows(rows, 0.0), seeds(rows))
            )
            task = runtime.prepare(call)
        return [e - b for b, e in family("sample_tokens").ranges(task, 16384)]

    assert cut(8, 256) == [1] * 8
    assert cut(1, 50257) == [1]
    assert cut(264, 256) == [2] * 132
    assert cut(200, 1000) == [2] * 100
    spread = cut(300, 1000)
    assert len(spread) == 100 and set(spread) == {3} and sum(spread) == 300
    spread = cut(301, 1000)
    assert len(spread) == 101 and set(spread) == {2, 3} and sum(spread) == 301


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"params": torch.ones(4, 3, dtype=torch.float16)},
            "input 1 (params: temperature, top_p, top_k) must be float32",
        ),
        ({"rng": torch.ones(4, 3)}, "input 2 (rng) is an index tensor: it must be int32"),
        (
            {"params": torch.ones(4, 2)},
            "params (temperature, top_p, top_k) (4, 2) must broadcast to (4, 3)",
        ),
        (
            {"rng": torch.ones(3, 3, dtype=torch.int32)},
            "rng (seed low word, seed high word, step) (3, 3) must broadcast to (4, 3)",
        ),
        ({"logits": torch.ones(4, 0)}, "logits rows must not be empty"),
        (
            {"out_dtype": torch.float32},
            "sample_tokens returns torch.int32; out_dtype torch.float32",
        ),
        ({"out": torch.ones(4)}, "out must be a torch.int32 tensor of shape (4,)"),
    ],
)
def test_validation_messages(change: dict, message: str) -> None:
    args = {"logits": torch.randn(4, 10), "params": params_rows(4, 1.0), "rng": seeds(4)}
    args.update(change)
    extra = {k: args.pop(k) for k in ("out", "out_dtype") if k in args}
    with Runtime("cpu") as rt:
        with pytest.raises(TensorSpecError, match=re.escape(message)):
            rt.prepare(OpCall("sample_tokens", tuple(args.values()), **extra))
