"""gather_rows (embedding lookups inside a device program): out row r = table row index[r], zeros
for an index outside the table, against a loop over the rows, on each backend; a program rerun
after its index tensor changed; the validation messages."""

from __future__ import annotations

import pytest
import torch
from test_catalogue import DTYPES
from test_index_ops import ints, randn, run

from gpuos_core import OpCall, Runtime
from gpuos_core.errors import TensorSpecError


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def gathered(table: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The lookup by a loop over index's entries."""
    rows = table.cpu().reshape(-1, table.shape[-1])
    flat = index.cpu().flatten().tolist()
    out = torch.zeros((len(flat), rows.shape[1]), dtype=dtype)
    for r, i in enumerate(flat):
        if 0 <= i < rows.shape[0]:
            out[r] = rows[i].to(dtype)
    return out.reshape(*index.shape, rows.shape[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gather_looks_up_rows_with_padding(rt: Runtime, dtype: torch.dtype, rows: int) -> None:
    vocab, hidden = 50, 96
    table = randn(rt, (vocab, hidden), dtype, 21)
    gen = torch.Generator().manual_seed(rows)
    index = torch.randint(-2, vocab + 2, (rows,), generator=gen).to(torch.int32).to(rt.device)
    out = run(rt, OpCall("gather_rows", (table, index)))
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert torch.equal(out.cpu(), gathered(table, index, dtype))


def test_gather_from_a_strided_table_into_a_given_out_converting_dtype(rt: Runtime) -> None:
    table = randn(rt, (6, 4, 40), torch.float16, 22)[:, 1:3, ::2]  # rows 12 of 20, strided
    index = ints(rt, [[11, 0, -1], [3, 12, 5]])
    out = torch.full((2, 3, 20), 9.0, device=rt.device)
    assert run(rt, OpCall("gather_rows", (table, index), out=out)) is out
    assert torch.equal(out.cpu(), gathered(table, index, torch.float32))


def test_a_program_rereads_the_index_each_run(rt: Runtime) -> None:
    table = randn(rt, (10, 16), torch.float32, 23)
    index = ints(rt, [0, 0, 0])
    build = rt.program()
    looked_up = build.add(OpCall("gather_rows", (table, index)))
    doubled = build.add(OpCall("add", (looked_up, looked_up)))
    program = build.build()
    for ids in ([1, 2, 3], [9, -1, 4]):
        index.copy_(torch.tensor(ids, dtype=torch.int32))
        rt.submit(program).wait(30)
        assert torch.equal(doubled.cpu(), 2 * gathered(table, index, torch.float32))


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda t, i: OpCall("gather_rows", (t, i.float())),
            r"input 1 \(index\) is an index tensor",
        ),
        (lambda t, i: OpCall("gather_rows", (t[:, :0], i)), "table rows must not be empty"),
    ],
)
def test_gather_validation(rt: Runtime, call, message: str) -> None:
    table, index = randn(rt, (5, 8), torch.float32, 24), ints(rt, [1, 2])
    with pytest.raises(TensorSpecError, match=message):
        rt.prepare(call(table, index))
