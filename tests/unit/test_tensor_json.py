"""Tensors in JSON: non-finite values travel as "NaN", "Infinity", "-Infinity" both ways, null and
other non-numbers are refused, sizes are checked without overflow, and base64 tensors carry their
exact bits."""

from __future__ import annotations

import asyncio
import base64
import json
import math

import numpy as np
import pydantic
import pytest
import torch

from gpuos_core import OpCall
from gpuos_core.catalogue import CATALOGUE
from serving.errors import RequestTooLargeError, TensorDataError
from serving.jsonfast import INLINE_ELEMENTS, dumps, json_answer
from serving.schemas import OpRequest, TensorB64, TensorIn
from serving.tensors import ElementBudget, check_output_size, from_tensor, to_tensor

CPU = torch.device("cpu")


def tensor(data: list, **spec: object) -> torch.Tensor:
    return to_tensor(TensorIn(data=data, **spec), "input 0", CPU)


def test_non_finite_values_are_strings_and_distinct_in_answers() -> None:
    x = torch.tensor([1.5, math.nan, math.inf, -math.inf], dtype=torch.float16)
    assert dumps(from_tensor(x)) == (
        b'{"data":[1.5,"NaN","Infinity","-Infinity"],"shape":[4],"dtype":"float16"}'
    )


@pytest.mark.parametrize(
    "data", [[1.0, "NaN", "Infinity", "-Infinity"], [1.0, math.nan, math.inf, -math.inf]]
)
def test_non_finite_values_are_read_from_strings_and_literals(data: list) -> None:
    x = tensor(data)
    assert x[0] == 1 and x[1].isnan() and x[2] == math.inf and x[3] == -math.inf
    flat = tensor(["NaN", 2, 3, "-Infinity"], shape=[2, 2])
    assert flat.shape == (2, 2) and flat[0, 0].isnan() and flat[1, 1] == -math.inf


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([1.0, None], 'null is not a number; send NaN as "NaN"'),
        ([[1.0, None], [2.0, 3.0]], "null is not a number"),
        ([True, False], "got bool"),
        ([1.0, "nan"], "got str 'nan'"),
        ([[1.0], [2.0, 3.0]], "evenly nested"),
        ([10**400], "too large"),
    ],
)
def test_what_is_not_a_number_is_refused(data: list, words: str) -> None:
    with pytest.raises(TensorDataError, match=words):
        tensor(data)


def test_shapes_whose_element_count_overflows_int64_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="less than or equal"):
        OpRequest.model_validate({"inputs": [{"data": [], "shape": [2**62, 4]}]})
    with pytest.raises(TensorDataError, match="does not fit shape"):  # 2^31-1 cubed: no overflow
        tensor([], shape=[2**31 - 1] * 3)
    with pytest.raises(pydantic.ValidationError, match="at most 8"):
        OpRequest.model_validate({"inputs": [{"data": [1], "shape": [1] * 9}]})


def test_a_result_larger_than_the_limit_is_refused_before_it_is_allocated() -> None:
    results = ElementBudget(4096 + 3, "the results")
    call = OpCall("add", (torch.zeros(512, 1), torch.zeros(1, 512)))
    with pytest.raises(RequestTooLargeError, match=r"shape \[512, 512\]"):
        check_output_size(CATALOGUE["add"], call, results)
    check_output_size(CATALOGUE["add"], OpCall("add", (torch.zeros(3),)), results)  # prepare's
    check_output_size(
        CATALOGUE["add"], OpCall("add", (torch.zeros(64, 1), torch.zeros(1, 64))), results
    )
    # The budget is shared by a batch's calls: the 4096 elements above are used up.
    with pytest.raises(RequestTooLargeError, match="results have more than 4099 elements"):
        check_output_size(CATALOGUE["neg"], OpCall("neg", (torch.zeros(1),)), results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_b64_tensors_carry_every_bit_both_ways(dtype: torch.dtype) -> None:
    x = torch.tensor([[1.5, -0.0, math.nan], [math.inf, 1e-3, -7.25]]).to(dtype).t()  # strided
    out = from_tensor(x, "b64")
    assert (out["shape"], out["dtype"]) == ([3, 2], str(dtype).removeprefix("torch."))
    back = to_tensor(TensorB64.model_validate(out), "input 0", CPU)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN == NaN, -0.0 != 0.0
    assert back.dtype == dtype and torch.equal(back.view(bits), x.contiguous().view(bits))


def test_b64_bytes_are_little_endian_row_major() -> None:
    raw = np.array([[1, 2], [3, 4]], dtype="<f2").tobytes()
    x = to_tensor(
        TensorB64(b64=base64.b64encode(raw).decode(), shape=[2, 2], dtype="float16"), "input 0", CPU
    )
    assert x.tolist() == [[1, 2], [3, 4]]
    assert to_tensor(TensorB64(b64="", shape=[0, 4]), "input 0", CPU).shape == (0, 4)


@pytest.mark.parametrize("elements", [10, INLINE_ELEMENTS + 1])
def test_answers_are_written_whole_on_or_off_the_event_loop(elements: int) -> None:
    """Small answers are written on the event loop, large ones in a worker thread: the same JSON."""
    x = np.arange(elements, dtype=np.float32)
    response = asyncio.run(json_answer({"output": x, "replica": "r"}, elements))
    assert response.status_code == 200 and response.media_type == "application/json"
    assert json.loads(response.body) == {"output": x.tolist(), "replica": "r"}
