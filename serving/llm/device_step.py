"""An LLM step as one device program: the forward (forward.py) recorded by `ProgramOps`, then
sampling; the step's inputs in one int32 device buffer that the host rewrites with one copy.

Rows of a step (its `Layout`): rows 0..decode-1 are one per KV slot 0..decode-1 (a request with
one row this step sits at its slot's row; the others idle: token -1, no KV write, KV length 0),
then `groups` groups of GROUP_ROWS rows. A longer span (a prefill chunk) takes ceil(n /
GROUP_ROWS) groups in a row, its tokens first and idle rows after them; each group's attention
reads the keys and values of the slot its span has this step, through addresses the step
rebinds (`Program.rebind`), and idle groups read slot 0 with nothing to attend. Which row each
logits row takes is a step input too: a decode row's own, then each longer span's last row (a
step with groups gathers them; in a decode-only step they are its rows, read as they are). So
a program depends only on two counts: decode rows (a power of two) and groups (`bucket`).
Whatever the spans' slots, lengths and order, a replica meets a few layouts, kept built (a build
takes ~0.2 s on the H200 for the GPT-2-small shape, and the step waits for it); idle rows cost
little, as below a few hundred rows a linear's time is the weights' read, whatever the row count.

What changes per step (token ids, positions, KV rows and lengths, the logits rows, sampling
parameters and Philox counters) lives in `StepInputs`; operator versions resolve at each submit,
so a hot swap reaches the next step. An MLP's GELU runs inside its up projection (the catalogue's
`linear_gelu*`: a stage less a layer) only while the GELU operator is the catalogue's own
(`fusable`); the engine keys its programs by that, so a swapped GELU runs as a task of its own
from the next step on.

Steps chain on the device (`StepChain`), so the host queues step k + 1 while step k runs: every
program begins with `feed_tokens`, which waits for the previous step's `tick` (its last task) and
takes the tokens that step sampled for the rows the host marks `fed(p)` (the token of logits row
p, which the host has not seen yet); it samples into the chain's buffer of its parity and reads
the other's. A layout has a program per parity, so the program of step k + 1 never waits for the
one running step k.

A decode-only layout may run `steps` decode steps back to back in one program (vLLM's
multi-step): sub-step j's rows take the tokens sub-step j - 1 sampled (a `feed_tokens` inside the
program), at positions, KV rows, lengths and draws one further each; a row whose request has
fewer tokens left idles in the sub-steps past them. The host writes every sub-step's inputs with
the one copy, and reads back each sub-step's tokens at the end. So the host's work for a step
(scheduling, writing inputs, launching, reading back) is done once for `steps` tokens of every
request.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import numpy as np
import torch

from gpuos_core import OpCall, Runtime
from gpuos_core.batch import Uploads
from gpuos_core.catalogue import CATALOGUE
from gpuos_core.families import GATED, LinearPlan, gate_up, sm_count, wide_tiles
from gpuos_core.optable import OpTable
from gpuos_core.program import Arena, Program, ProgramBuilder
from serving.llm.forward import Span, forward, split_heads
from serving.llm.model import KVPool, Linear, Model, ModelConfig, Norm

IDLE = -1  # token, position and KV row of an idle row (gather_rows yields zeros, scatter skips)
GROUP_ROWS = 16  # rows of a group: a longer span takes ceil(n / GROUP_ROWS) of them
LANE_ROWS = 16  # rows of a lane, at least (lanes_of)
LANES = 2  # lanes of a step, at most
# Lanes of this many rows or more record their norms as sharing the machine (AddNormFamily.cut:
# several rows a record): their stages hold most blocks, and a record a row held more.
SHARED_NORM_ROWS = 32


# Activations an up projection can apply itself (the catalogue's linear_<activation>), each
# with the catalogue operator that applies it alone.
FUSABLE = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", GATED: "swiglu"}


def fusable(table: OpTable) -> frozenset[str]:
    """The activations a step program may apply inside its up projection under `table` (a
    runtime's operator table): those of FUSABLE whose operator's current version is the
    catalogue's (a swapped one must run as its own operator)."""
    return frozenset(
        kind for kind, op in FUSABLE.items() if table.current(op).spec is CATALOGUE[op]
    )


@overload
def fed(pick: int) -> int: ...
@overload
def fed(pick: np.ndarray) -> np.ndarray: ...
def fed(pick: int | np.ndarray) -> int | np.ndarray:
    """The token of a row that takes what the previous step sampled for its logits row `pick`
    (feed_tokens, cuda/ops/steps.cuh); elementwise over an array of picks."""
    return -2 - pick


def groups_of(tokens: int) -> int:
    """Groups a span of `tokens` takes (or a budget of that many rows needs)."""
    return -(-tokens // GROUP_ROWS)


def power_of_two(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def bucket(n: int) -> int:
    """The least of 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^k) >= n (n >= 1): a count rounded up
    by at most a third, from few values."""
    return min(power_of_two(n), 3 * power_of_two(-(-n // 3)))


@dataclass(frozen=True)
class Placement:
    """Where one step's spans sit in its layout's rows (Layout.place)."""

    first: np.ndarray  # per span: its first row
    pick: np.ndarray  # per span: its logits row
    rows: np.ndarray  # per logits row: the row whose logits it takes (idle ones: row 0)
    slots: np.ndarray  # per group: the KV slot its attention reads (idle ones: slot 0)


@dataclass(frozen=True)
class Layout:
    """Where a step's spans sit: see the module docstring."""

    decode: int  # rows 0..decode-1: KV slots 0..decode-1
    groups: int  # then this many groups of GROUP_ROWS rows, for the longer spans
    steps: int = 1  # decode steps the program runs back to back (decode rows only beyond 1)

    def __post_init__(self) -> None:
        if self.steps < 1 or (self.steps > 1 and self.groups):
            raise ValueError(f"{self}: only a decode-only layout runs several steps")

    @classmethod
    def of(cls, spans: Sequence[Span], slots: int, steps: int = 1) -> Layout:
        """The layout of `spans` in a pool of `slots`, run `steps` times (decode spans only
        beyond one): decode rows rounded up to a power of two (at most `slots`) and groups to a
        `bucket`, so that a request joining or leaving, or a prompt of another length, rarely
        needs a new program."""
        singles = [s.slot for s in spans if len(s.tokens) == 1]
        decode = decode_rows(max(singles) + 1, slots) if singles else 0
        need = sum(groups_of(len(s.tokens)) for s in spans if len(s.tokens) > 1)
        return cls(decode, bucket(need) if need else 0, steps)

    @classmethod
    def decoding(cls, slots: int, steps: int) -> list[Layout]:
        """Every layout of a step with decode rows only, in a pool of `slots`, run once or
        `steps` times."""
        counts = {decode_rows(1 << k, slots) for k in range(math.ceil(math.log2(slots)) + 1)}
        return [cls(rows, 0, n) for rows in sorted(counts) for n in sorted({1, steps})]

    @staticmethod
    def most_picks(slots: int, step_tokens: int) -> int:
        """Logits rows of any layout of steps of at most `step_tokens` tokens from `slots`
        requests (each longer span wastes less than a group)."""
        return slots + bucket(groups_of(step_tokens) + slots)

    @property
    def rows(self) -> int:
        return self.decode + self.groups * GROUP_ROWS

    @property
    def picks(self) -> int:
        """Logits rows: one per decode row and per group (a longer span takes one at least)."""
        return self.decode + self.groups

    def place(self, spans: Sequence[Span]) -> Placement:
        """Where `spans` (which this layout fits: Layout.of) sit: decode spans at their slots'
        rows, longer ones in groups in the order given."""
        n = len(spans)
        rows = np.zeros(self.picks, dtype=np.int64)
        rows[: self.decode] = np.arange(self.decode)
        slots = np.zeros(self.groups, dtype=np.int64)
        if not self.groups:  # every span is one decode row (Layout.of): no loop over them
            first = np.fromiter([s.slot for s in spans], np.int64, n)
            return Placement(first, first, rows, slots)
        first, pick = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        group, longer = 0, self.decode
        for i, s in enumerate(spans):
            if len(s.tokens) == 1:
                first[i] = pick[i] = s.slot
                continue
            taken = groups_of(len(s.tokens))
            first[i], pick[i] = self.decode + group * GROUP_ROWS, longer
            rows[longer] = first[i] + len(s.tokens) - 1
            slots[group : group + taken] = s.slot
            group, longer = group + taken, longer + 1
        return Placement(first, pick, rows, slots)


def lanes_of(layout: Layout, model: Model, sms: int) -> tuple[slice, ...]:
    """The rows of each lane of a step of `layout` through `model`, on a worker of `sms` blocks.
    A decode step's rows are independent until its logits, so it may run as lanes: each operator
    recorded once per lane, over the lane's rows, lane after lane at each stage. A lane's tasks
    depend only on its own earlier tasks, so one lane's next stage runs beside another's current
    one, on SMs a single lane's linears leave idle (GPT-2-small at 64 rows: 36-72 records on 132
    SMs, ~10-16 µs each). Up to LANES lanes, each of LANE_ROWS rows at least, while every lane's
    tiles of its widest linear still find a block each: past that the lanes only read the
    weights twice (Llama-3.2-1B, 256 tiles: its 64-row step 30% slower in two lanes). A step
    with longer spans is one lane."""
    layers = model.weights.layers
    widest = max(p.weight.shape[0] for w in layers for p in (w.qkv, w.o, w.up, w.down))
    count = 1 if layout.groups else _cuts(layout.decode, widest, sms, LANES)
    return _cut(layout.rows, count)


def head_cuts(rows: int, vocab: int, sms: int) -> tuple[slice, ...]:
    """The rows of each LM head task of a step of `rows` logits rows: as many cuts of LANE_ROWS
    rows or more as still find a block per tile of the `vocab` outputs on `sms` blocks. A small
    vocabulary's head is a few tiles, whose records otherwise run all the rows on a few SMs
    (GPT-2-small's 256-vocab head, 4 tiles: a 64-row record took 18.7 µs on the step's path, a
    16-row one 4.6; H200, s317); a large one fills the worker at any row count and is one task."""
    return _cut(rows, _cuts(rows, vocab, sms, rows // LANE_ROWS))


def _cuts(rows: int, outputs: int, sms: int, most: int) -> int:
    """The most cuts of `rows`, up to `most`, each of LANE_ROWS rows or more, whose tiles of a
    linear of `outputs` all find a block on `sms` blocks (1 where none do)."""

    def fits(count: int) -> bool:
        part = rows // count
        return part >= LANE_ROWS and count * LinearPlan(part, outputs, 1, 1).tiles <= sms

    return max((n for n in range(2, most + 1) if fits(n)), default=1)


def _cut(rows: int, count: int) -> tuple[slice, ...]:
    """`rows` rows as `count` runs of consecutive rows, as even as they come."""
    return tuple(slice(i * rows // count, (i + 1) * rows // count) for i in range(count))


def decode_rows(used: int, slots: int) -> int:
    """Decode rows of a step whose highest slot in use is `used` - 1: a power of two, at most
    `slots`."""
    return min(power_of_two(used), slots)


class StepWork(NamedTuple):
    """What one step runs: the spans, each span's row run `takes` times back to back (all 1, or
    for decode spans only up to the program's steps, the most of them that), their sampling
    rows (params float32 and rng int32, [spans, 3] each: the first run's draws), and whether
    the logits come back too."""

    spans: Sequence[Span]
    takes: Sequence[int]
    params: np.ndarray
    rng: np.ndarray
    keep_logits: bool

    @property
    def steps(self) -> int:
        """Decode steps its program runs back to back."""
        return max(self.takes)


# Inputs of each sub-step of a layout's program (StepInputs: [steps, ...]); the others are shared.
STEPWISE = ("tokens", "positions", "kv_rows", "lengths", "rng")


class StepInputs:
    """The per-step tensors of one layout, views of one int32 device buffer, and the pinned host
    copy they are written from (one copy a step)."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        n, r, k = layout.rows, layout.picks, layout.steps
        sizes = {
            "tokens": k * n,
            "positions": k * n,
            "kv_rows": k * n,
            "lengths": k * n,
            "picks": r,
            "rng": k * 3 * r,
            "params": 3 * r,
            "expect": 1,
        }
        pinned = device.type == "cuda"
        self.host = torch.empty(sum(sizes.values()), dtype=torch.int32, pin_memory=pinned)
        self.device = self.host.to(device) if pinned else self.host  # the CPU backend reads it
        self.layout = layout
        self._host: dict[str, np.ndarray] = {}  # numpy views of the pinned copy
        self._device: dict[str, torch.Tensor] = {}  # the same words on the device
        # What `write` starts from, in one copy: every row idle (token, position and KV row
        # IDLE, KV length 0) and greedy picks without draws (params and rng 0)
        self._idle = np.zeros(len(self.host), dtype=np.int32)
        at = 0
        for name, size in sizes.items():
            self._host[name] = self.host[at : at + size].numpy()
            self._device[name] = self.device[at : at + size]
            if name in ("tokens", "positions", "kv_rows"):
                self._idle[at : at + size] = IDLE
            at += size
        self._words = self.host.numpy()
        self._params = self._host["params"].view(np.float32).reshape(-1, 3)
        self._rng = self._host["rng"].reshape(k, -1, 3)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The device view named: those of STEPWISE [steps, ...] (`rng` [steps, picks, 3]),
        `params` float32 [picks, 3]."""
        view = self._device[name]
        if name == "params":
            return view.view(torch.float32).view(-1, 3)
        if name == "rng":
            return view.view(self.layout.steps, -1, 3)
        return view.view(self.layout.steps, -1) if name in STEPWISE else view

    def write(self, work: StepWork, placed: Placement, max_len: int, expect: int) -> None:
        """Fill the host words for `work`'s spans where `placed` puts them, each span's row for
        its first `takes` sub-steps, idle rows and greedy idle picks elsewhere, and the clock
        value to wait for; `uploads` takes them to the device."""
        host = self._host
        np.copyto(self._words, self._idle)  # one numpy call, where a fill per name took seven
        host["expect"][0] = expect
        host["picks"][:] = placed.rows
        # the spans' columns, taken apart without Python per span (there is one a request)
        slots, starts, tokens = zip(*work.spans)
        n = len(slots)
        positions = np.fromiter(starts, np.int64, n)
        if self.layout.groups:
            counts = np.fromiter(map(len, tokens), np.int64, n)
            # row r of span i: first_i + k, position start_i + k, for k < count_i (no loop per
            # row)
            k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            rows = np.repeat(placed.first, counts) + k
            positions = np.repeat(positions, counts) + k
            kv_slots = np.repeat(np.fromiter(slots, np.int64, n), counts)
        else:  # every span is one decode row, at its slot's (place)
            rows = kv_slots = placed.first
        # the first sub-step's words come first in each STEPWISE array
        host["tokens"][rows] = list(itertools.chain.from_iterable(tokens))
        host["positions"][rows] = positions
        host["kv_rows"][rows] = kv_slots * max_len + positions
        host["lengths"][rows] = positions + 1
        self._params[placed.pick] = work.params
        self._rng[0, placed.pick] = work.rng
        if self.layout.steps > 1:
            self._later_steps(placed, np.asarray(work.takes))

    def _later_steps(self, placed: Placement, takes: np.ndarray) -> None:
        """Sub-steps 1.. of a decode-only layout, from the first's words: each row in the first
        `takes` sub-steps takes the token its logits row sampled in the sub-step before, one
        position (KV row, length, draw) further; idle after them."""
        host, k = self._host, self.layout.steps
        rows, later = placed.first, np.arange(1, k)[:, None]
        on = takes[None, :] > later  # [sub-steps 1.., spans]
        host["tokens"].reshape(k, -1)[1:, rows] = np.where(on, fed(placed.pick), IDLE)
        for name, idle in (("positions", IDLE), ("kv_rows", IDLE), ("lengths", 0)):
            grid = host[name].reshape(k, -1)
            grid[1:, rows] = np.where(on, grid[0, rows] + later, idle)
        rng = self._rng
        rng[1:, placed.pick] = rng[0, placed.pick]
        rng[1:, placed.pick, 2] += later.astype(np.int32)  # the draw's counter

    @property
    def uploads(self) -> Uploads:
        """What copies the host words to the device with the step's submission (nothing where
        the device reads the host words themselves)."""
        return () if self.device is self.host else ((self.device, self.host),)


class StepChain:
    """What chains one engine's steps on the device: the clock every step ticks, and per parity
    what its steps hand back, one per logits row (at most `picks`) and sub-step (at most
    `steps`, the last first: the next step's feed_tokens reads row 0): the sampled tokens, then
    the logits rows' sums (float32 bits), so that the host reads both with one copy."""

    def __init__(self, picks: int, steps: int, device: torch.device) -> None:
        self.clock = torch.zeros(1, dtype=torch.int32, device=device)
        shape = (2, 2, steps, picks)
        self.sampled = torch.full(shape, IDLE, dtype=torch.int32, device=device)
        pinned = torch.empty(shape, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = pinned.numpy()  # where the host reads `sampled` to (keeps `pinned` alive)
        self.launched = 0  # steps launched: the clock's value once they all ticked

    @property
    def parity(self) -> int:
        """The parity of the step about to launch (which program of its layout runs it)."""
        return self.launched % 2

    def next(self) -> int:
        """The clock value the step about to launch waits for; counts it."""
        step, self.launched = self.launched, self.launched + 1
        return (step + 2**31) % 2**32 - 2**31  # as int32, wrapping like the clock

    def resync(self) -> None:
        """Start counting from the clock again (after a failed step, whose tick may be
        missing); the caller has waited for the steps launched."""
        self.launched = int(self.clock.item()) % 2**32


class ProgramOps:
    """MicroOps that record each call of sub-step `step` into a device program over a layout's
    rows (see forward.py for the contracts; `inputs` holds what changes per step). Its first
    task takes the rows' tokens from the inputs and from `feed` (feed_tokens: the tokens sampled
    before, and the clock); the activations in `fused` run inside their up projections; each
    operator runs once per lane of `lanes` (lanes_of), on a worker of `sms` blocks."""

    def __init__(
        self,
        build: ProgramBuilder,
        config: ModelConfig,
        pool: KVPool,
        inputs: StepInputs,
        step: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        feed: tuple[torch.Tensor, torch.Tensor],
        fused: frozenset[str],
        lanes: tuple[slice, ...],
        sms: int,
    ) -> None:
        self.build, self.config, self.pool, self.inputs = build, config, pool, inputs
        self.step, self.fused = step, fused
        self.layout, self.tables = inputs.layout, rotary
        # (task, operand, group): operands that view KV slot 0 in the records, where each step
        # binds the slot of the group's span (Program.binding)
        self.kv_uses: list[tuple[int, int, int]] = []
        self.stores: list[int] = []  # the tasks that store the rows' keys and values
        self._late: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # stores after the head
        self.lanes, self.sms = lanes, sms  # the rows of each (lanes_of); the worker's blocks
        sampled, clock = feed
        tokens = self._input("tokens")
        self.tokens = self._add("feed_tokens", tokens, sampled, clock, inputs["expect"])

    def _input(self, name: str) -> torch.Tensor:
        """This sub-step's device view of the input `name` (of STEPWISE)."""
        return self.inputs[name][self.step]

    def _add(
        self,
        op: str,
        *inputs: torch.Tensor,
        out: torch.Tensor | None = None,
        share: int | None = None,
        **scalars: float,
    ) -> torch.Tensor:
        return self.build.add(OpCall(op, inputs, out=out, scalars=scalars, share=share))

    def _lanes(
        self,
        op: str,
        inputs: Callable[[slice], tuple[torch.Tensor, ...]],
        out: torch.Tensor,
        share: int | None = None,
        **scalars: float,
    ) -> torch.Tensor:
        """`op` once per lane: of `inputs(rows)` into `out[rows]`, rows the lane's (OpCall.share
        `share`). Returns out."""
        for rows in self.lanes:
            self._add(op, *inputs(rows), out=out[rows], share=share, **scalars)
        return out

    def _rows(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, width] output of the program, that each lane writes its rows of."""
        return self.build.empty((self.layout.rows, width), dtype)

    def embed(
        self, table: torch.Tensor, positions: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokens
        x = self._lanes(
            "gather_rows", lambda r: (table, tokens[r]), self._rows(table.shape[1], table.dtype)
        )
        if positions is None:
            return x, self._normed("", norm, x, lambda r: (x[r],))
        # the norm adds the position rows as it reads x: no stage of their own
        at = self._input("positions")
        pos = self._lanes(
            "gather_rows",
            lambda r: (positions, at[r]),
            self._rows(positions.shape[1], positions.dtype),
        )
        return x, self._normed("add_", norm, x, lambda r: (x[r], pos[r]))

    def residual(
        self, x: torch.Tensor, h: torch.Tensor, linear: Linear, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the projection's K splits are summed by the norm as it adds them: no combine stage
        parts = self._parts(h, linear)
        return x, self._normed("add_", norm, x, lambda r: (x[r], parts[r.start]))

    def _parts(self, h: torch.Tensor, linear: Linear) -> dict[int, torch.Tensor]:
        """`linear_parts` of each lane's rows of h, by the lane's first row: its K splits' sums
        [S, rows, N] (fp32), for a consumer that sums them as it reads them. Each lane's splits
        are a tensor of their own, as many as its share of the SMs keeps busy (GPT-2's down
        projection at 64 rows: 72 records a lane, planned for the whole worker, were claimed
        late; 48 a lane made the step 3.5% shorter). One lane plans for the blocks h's
        producers leave free (LinearPlan.choose's `free`). A producer that takes every block
        leaves the projection's records late whatever their count; so do lanes, whose other
        lane's stages hold blocks beside this one's producer (planned around both lanes'
        attention, the small Llama shape's 64-row step took 5% longer; s206)."""
        (n, k), weights = linear.weight.shape, self._weights(linear)
        share = self.sms // len(self.lanes)
        busy = self.build.records_writing(h) if len(self.lanes) == 1 else 0
        free = self.sms - busy if 0 < busy < self.sms else None
        parts, wide = {}, wide_tiles(h.device)
        for r in self.lanes:
            rows = r.stop - r.start
            splits = LinearPlan.choose(rows, n, k, share, True, free, wide).splits
            out = self.build.empty((splits, rows, n), torch.float32)
            parts[r.start] = self._add("linear_parts", h[r], *weights, out=out)
        return parts

    def _normed(
        self,
        prefix: str,
        norm: Norm,
        x: torch.Tensor,
        rows: Callable[[slice], tuple[torch.Tensor, ...]],
    ) -> torch.Tensor:
        """LayerNorm (the norm has a bias) or RMSNorm of each lane's `rows`, in x's dtype (the
        residual may come as fp32 partial sums), through the catalogue operator `prefix` names
        ("add_": the fused residual add of the two rows given); lanes of SHARED_NORM_ROWS rows
        or more record it as sharing the machine."""
        kind = "rmsnorm" if norm.bias is None else "layernorm"
        weights, lanes = self._weights(norm), self.lanes
        shared = len(lanes) > 1 and lanes[0].stop - lanes[0].start >= SHARED_NORM_ROWS
        out = self._rows(x.shape[1], x.dtype)
        return self._lanes(
            prefix + kind,
            lambda r: (*rows(r), *weights),
            out,
            len(lanes) if shared else None,
            eps=self.config.norm_eps,
        )

    def qkv(
        self, h: torch.Tensor, linear: Linear
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        if self.tables is None:
            return split_heads(c, self._linear("linear", h, linear))
        cos, sin = self.tables
        at, width = self._input("positions")[:, None], c.heads + c.kv_heads
        heads = width + c.kv_heads
        if self.layout.groups:
            # prefill rows: the projection whole, then q's and k's heads (its first `width`)
            # rotated in place as one task (rotary on q, then on k, were a chain of two stages:
            # their views' spans meet in the rows' storage). Summed from fp32 parts instead,
            # 512 rows cost the rotary more than the combine it spared (H200, s277).
            out = self._linear("linear", h, linear)
            rotated = out.unflatten(-1, (heads, c.head_dim))[:, :width]
            self._lanes("rotary", lambda r: (rotated[r], cos, sin, at[r]), rotated)
            return split_heads(c, out)
        # decode rows: the projection's K splits summed by the rotary as it reads them (its v
        # heads only summed), so no combine, which took 3 of a Llama-3.2-1B QKV record's 8 us
        # at one row: its step 3.4% shorter, 2% at 8 rows, the same at 64 (H200, s278)
        parts, out = self._parts(h, linear), self._rows(linear.weight.shape[0], h.dtype)

        def inputs(r: slice) -> tuple[torch.Tensor, ...]:
            return parts[r.start].unflatten(-1, (heads, c.head_dim)), cos, sin, at[r]

        rows = out.unflatten(-1, (heads, c.head_dim))
        self._lanes("rotary_parts", inputs, rows, rotated=width)
        return split_heads(c, out)

    def _linear(
        self, op: str, x: torch.Tensor, linear: Linear, pairs: bool = False
    ) -> torch.Tensor:
        """`op` of x through `linear`; `pairs`: its outputs are pairs of W's rows (SwiGLU's)."""
        weights = self._weights(linear)
        out = self._rows(linear.weight.shape[0] // (2 if pairs else 1), x.dtype)
        return self._lanes(op, lambda r: (x[r], *weights), out)

    @staticmethod
    def _weights(params: Linear | Norm) -> tuple[torch.Tensor, ...]:
        """The weight, and the bias where there is one: the operators' trailing inputs."""
        return (params.weight,) if params.bias is None else (params.weight, params.bias)

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # The decode rows read their newest key and value from k and v themselves, so where no
        # longer span (whose attention reads its keys from the cache) is in the step, the keys
        # and values are stored after the LM head (`logits`): off the step's path, and past
        # the layers' records in claim order, where a store waiting for its attention would
        # hold a block that the next stage's records want (the tick waits for the stores, so
        # the next step sees them).
        if self.layout.groups:
            self._store(layer, k, v)
        else:
            self._late.append((layer, k, v))
        out = self.build.empty(tuple(q.shape), q.dtype)
        first = self.layout.decode
        for lane in self.lanes:
            rows = slice(lane.start, min(lane.stop, first))
            if rows.start < rows.stop:  # a decode row reads its slot's keys
                self._attend(layer, q, out, rows, rows, (k[rows], v[rows]))
        for group in range(self.layout.groups):
            task = len(self.build)
            rows = slice(first, first + GROUP_ROWS)
            # its slot: bound at each step; the groups' tasks run side by side
            self._attend(layer, q, out, rows, slice(0, 1), share=self.layout.groups)
            self.kv_uses += [(task, 1, group), (task, 2, group)]
            first += GROUP_ROWS
        return out

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The rows' k and v [N, kv_heads, d] into the cache at their KV rows."""
        for new, cache in ((k, self.pool.keys[layer]), (v, self.pool.values[layer])):
            self.stores.append(len(self.build))
            # views, never copies: the program reads these tensors' memory at every run
            self._add(
                "scatter_rows",
                new.view(new.shape[0], -1),
                self._input("kv_rows"),
                out=cache.view(-1, new.shape[1] * new.shape[2]),
            )

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
        rows: slice,
        slots: slice,
        newest: tuple[torch.Tensor, torch.Tensor] | None = None,
        share: int | None = None,
    ) -> None:
        """Attention of q's `rows` over the keys of KV `slots` (one slot per row, or one slot
        that every row reads), each row over its own length; its newest key and value from
        `newest` (the rows' k and v [n, kv_heads, d]) where given; `share`: OpCall.share."""
        c = self.config
        group, n = c.heads // c.kv_heads, rows.stop - rows.start
        heads = (n, c.kv_heads, group, c.head_dim)

        # [slots, len, kv, d] -> [n, kv, group, len, d]
        def kv(cache: torch.Tensor) -> torch.Tensor:
            view = cache[slots].permute(0, 2, 1, 3)[:, :, None]
            return view.expand(n, c.kv_heads, group, *view.shape[-2:])

        # [n, kv, d] -> [n, kv, group, d]
        rows_of = [x[:, :, None].expand(heads) for x in newest or ()]
        lengths = self._input("lengths")[rows].view(n, 1, 1)
        keys, values = kv(self.pool.keys[layer]), kv(self.pool.values[layer])
        target = out[rows].view(heads)
        views: tuple[torch.Tensor, ...] = (q[rows].view(heads), keys, values, lengths, target)
        if newest is None:
            # rows of one slot (a chunk's) innermost: up to 8 of them, each over its own length,
            # share an item's pass over the slot's keys (AttentionPlan: ragged groups)
            views = tuple(x.movedim(0, 2) for x in views)
        *inputs, target = views
        self.build.add(
            OpCall(
                "attention_decode",
                (*inputs, *rows_of),
                out=target,
                scalars={"scale": 1 / math.sqrt(c.head_dim)},
                share=share,
            )
        )

    def activated(self, x: torch.Tensor, linear: Linear, kind: str) -> torch.Tensor:
        if kind in self.fused:
            return self._linear(f"linear_{kind}", x, linear, pairs=kind == GATED)
        h = self._linear("linear", x, linear)
        if kind == GATED:
            gate, up = gate_up(h)
            return self._lanes(
                "swiglu", lambda r: (gate[r], up[r]), self._rows(up.shape[1], h.dtype)
            )
        # "gelu" and "gelu_tanh" are catalogue operators
        return self._lanes(kind, lambda r: (h[r],), self._rows(h.shape[1], h.dtype))

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        # a decode-only step's logits rows are its rows (Layout.place): no stage to gather them
        rows = self._add("gather_rows", h, self.inputs["picks"]) if self.layout.groups else h
        out = self.build.empty((self.layout.picks, head.shape[0]), torch.float32)
        for cut in head_cuts(self.layout.picks, head.shape[0], self.sms):
            self._add("linear", rows[cut], head, out=out[cut])
        for stored in self._late:
            self._store(*stored)
        return out


@dataclass(frozen=True)
class StepResult:
    """What a step hands back, per span in the order given, per sub-step (one, unless the step
    ran several: Layout.steps)."""

    tokens: list[list[int]]  # the tokens chosen from the span's last row, a sub-step each it ran
    finite: list[list[bool]]  # whether those rows' logits were all finite
    logits: torch.Tensor | None  # [spans, steps, vocab] fp32 on the CPU, when asked for


@dataclass(frozen=True)
class Launched:
    """A step on its way: each span's logits row (what `fed` names in the next step), and the
    call that waits for the step and reads back its tokens."""

    picks: list[int]
    result: Callable[[], StepResult]


class StepProgram:
    """The device program of one layout and parity: per sub-step, the forward, sampling into the
    chain and a row sum of the logits (a non-finite logit makes it non-finite); then the tick;
    with its inputs; the activations in `fused` (of `fusable`) inside their up projections."""

    def __init__(
        self,
        rt: Runtime,
        model: Model,
        pool: KVPool,
        layout: Layout,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        chain: StepChain,
        parity: int,
        arena: Arena,
        fused: frozenset[str],
    ) -> None:
        """`arena`: where its activations live, shared by the programs of its parity (a step of
        one parity runs only once the step before the last has been read back)."""
        self.inputs = StepInputs(layout, rt.device)
        build = rt.program(arena)
        sms = sm_count(rt.device)
        lanes = lanes_of(layout, model, sms)
        self.readback = chain.sampled[parity]  # [tokens, sums] x sub-steps: what the host reads
        self.host = chain.host[parity]  # ... into these words
        sampled, stores, self.logits = chain.sampled[1 - parity, 0, 0], [], []
        for step in range(layout.steps):
            ops = ProgramOps(
                build,
                model.config,
                pool,
                self.inputs,
                step,
                rotary,
                (sampled, chain.clock),
                fused,
                lanes,
                sms,
            )
            logits = forward(model, ops)
            # the last sub-step's tokens at row 0: where the next step's feed_tokens reads them
            row = layout.steps - 1 - step
            sampled = self.readback[0, row]
            inputs = (logits, self.inputs["params"], self.inputs["rng"][step])
            tokens = build.add(OpCall("sample_tokens", inputs, out=sampled[: layout.picks]))
            sums = self.readback[1, row, : layout.picks].view(torch.float32)
            build.add(OpCall("sum", (logits,), out=sums, dims=(1,)))
            stores += ops.stores
            self.logits.append(logits)
        build.add(OpCall("tick", (tokens,), out=chain.clock), after=stores)
        self.program: Program = build.build()
        self.layout, self.max_len = layout, pool.max_len
        # A group's KV views sit at slot 0 in the records: binding "address" s * slot_bytes
        # (plus the view's own address, kept as the delta) points them at slot s. (A layout
        # with groups runs one sub-step: `ops` recorded all of them.)
        assert pool.keys.stride() == pool.values.stride(), "keys and values share one layout"
        self.slot_bytes = pool.keys.stride(1) * pool.keys.element_size()
        groups = layout.groups
        self.binding = self.program.binding(ops.kv_uses, [0] * groups) if groups else None

    def start(self, rt: Runtime, work: StepWork, timeout: float, expect: int) -> Launched:
        """Write the step's inputs (`expect`: the clock value of the previous step's tick) and
        submit the program; the result waits for it and reads back the spans' tokens, `takes`
        each."""
        placed = self.layout.place(work.spans)
        self.inputs.write(work, placed, self.max_len, expect)
        if self.binding is not None:
            addresses = placed.slots.astype(np.uint64) * np.uint64(self.slot_bytes)
            self.program.rebind(self.binding, addresses)
        batch = rt.submit(self.program, self.inputs.uploads)
        picks = placed.pick.tolist()
        steps = slice(self.layout.steps - 1, None, -1)  # the sub-steps' rows, in their order

        def result() -> StepResult:
            batch.wait(timeout).check()
            # one copy that keeps the GIL, and numpy: each torch call lets it go (engine._Outbox)
            rt.read(self.readback, self.host)
            rows = placed.pick  # an array: numpy would make one of the list each time
            tokens, sums = self.host[0][steps][:, rows], self.host[1][steps][:, rows]
            chosen, finite = tokens.T.tolist(), np.isfinite(sums.view(np.float32)).T.tolist()
            if self.layout.steps > 1:  # a row idles in the sub-steps past its takes
                chosen = [row[:n] for row, n in zip(chosen, work.takes)]
                finite = [row[:n] for row, n in zip(finite, work.takes)]
            logits = (
                torch.stack([x[picks] for x in self.logits], 1).cpu() if work.keep_logits else None
            )
            return StepResult(chosen, finite, logits)

        return Launched(picks, result)
