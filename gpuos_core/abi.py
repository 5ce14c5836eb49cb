"""Python mirror of cuda/gpuos_abi.h and the encoding of torch tensors into task descriptors.

The numpy structured dtypes below must agree byte for byte with the C structs;
tests/unit/test_abi.py compiles the header with the host C compiler and compares every size and
offset.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import torch

from .errors import TensorSpecError

ABI_VERSION = 3
MAX_DIMS = 6
MAX_INPUTS = 4
MAX_SCALARS = 4
MAX_WAITS = 2
NO_EVENT = -1
OP_NOP = -2
TASK_EARLY = 1  # flags: the operator awaits the record's events itself (gpuos_abi.h)
TASK_LOCAL = 2 << MAX_INPUTS  # flags: a later record of its program waits for it (gpuos_abi.h)
DYNAMIC_SMEM = 73856  # bytes of dynamic shared memory a worker block asks for (gpuos_abi.h)


def task_settled(k: int) -> int:
    """flags bit GPUOS_TASK_SETTLED(k): no record this one waits for writes input k."""
    return 2 << k


# GPUOS_DTYPE_* codes, and the torch dtypes the runtime accepts (int32 only as an operator's index
# input: the catalogue checks which inputs may be indices).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.int32: 3,
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

TENSOR_REF = np.dtype(
    [
        ("data", "<u8"),
        ("numel", "<i8"),
        ("sizes", "<i8", (MAX_DIMS,)),
        ("strides", "<i8", (MAX_DIMS,)),
        ("dtype", "<i4"),
        ("ndim", "<i4"),
    ],
    align=True,
)

TASK = np.dtype(
    [
        ("op_slot", "<i4"),
        ("num_inputs", "<i2"),
        ("flags", "<i2"),
        ("reduce_mask", "<u4"),
        ("signal", "<i4"),
        ("range_begin", "<i8"),
        ("range_end", "<i8"),
        ("scalars", "<f4", (MAX_SCALARS,)),
        ("events", "<u8"),
        ("wait", "<i4", (MAX_WAITS,)),
        ("wait_count", "<u4", (MAX_WAITS,)),
        ("out", TENSOR_REF),
        ("in", TENSOR_REF, (MAX_INPUTS,)),
    ],
    align=True,
)
# The same bytes as one opaque item: copying records this way is a memcpy, not a field walk.
RAW_TASK = np.dtype((np.void, TASK.itemsize))

QUEUE = np.dtype([("tail", "<u8"), ("head", "<u8"), ("stop", "<u8"), ("claim", "<u8")], align=True)


def field_offset(record: np.dtype, name: str) -> int:
    """Byte offset of field `name` of the structured dtype `record` (TASK, QUEUE)."""
    fields = record.fields
    assert fields is not None, f"{record} has no fields"
    return fields[name][1]


def dtype_code(dtype: torch.dtype) -> int:
    """GPUOS_DTYPE_* code of a torch dtype; TensorSpecError for dtypes the runtime does not take."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TensorSpecError(f"dtype {dtype} is not supported: use one of {names}") from None


# TASK packed field by field in one call: numpy's structured-field writes cost ~40 us a record.
_REF_FORMAT = f"Qq{MAX_DIMS}q{MAX_DIMS}qii"
TASK_STRUCT = struct.Struct(
    f"<ihhIiqq{MAX_SCALARS}fQ{MAX_WAITS}i{MAX_WAITS}I" + _REF_FORMAT * (1 + MAX_INPUTS)
)
assert TASK_STRUCT.size == TASK.itemsize, "TASK_STRUCT must mirror TASK"
REF_STRUCT = struct.Struct("<" + _REF_FORMAT)  # one TENSOR_REF (an operator's workspace holds some)
assert REF_STRUCT.size == TENSOR_REF.itemsize, "REF_STRUCT must mirror TENSOR_REF"
_NO_TENSOR = (0, 0) + (0,) * (2 * MAX_DIMS) + (0, 0)
_NO_DEPS = (0,) + (NO_EVENT,) * MAX_WAITS + (0,) * MAX_WAITS  # events, wait[], wait_count[]


def tensor_fields(tensor: torch.Tensor) -> tuple[int, ...]:
    """The TENSOR_REF values of `tensor` in field order (sizes and strides in elements)."""
    ndim = tensor.dim()
    if ndim > MAX_DIMS:
        raise TensorSpecError(f"tensor has {ndim} dims; at most {MAX_DIMS} are supported")
    pad = MAX_DIMS - ndim
    return (
        tensor.data_ptr(),
        tensor.numel(),
        *tensor.shape,
        *(1,) * pad,
        *tensor.stride(),
        *(0,) * pad,
        dtype_code(tensor.dtype),
        ndim,
    )


def encode_task(
    records: np.ndarray,
    ranges: list[tuple[int, int]],
    out: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    scalars: tuple[float, ...] = (),
    reduce_mask: int = 0,
) -> None:
    """Fill TASK records[i] for each work-item range [begin, end) of one task, with no event to
    wait for or signal (a Program adds those); op_slot is left 0 for submit to resolve. Flags:
    TASK_EARLY, as every operator awaits its own events (each family macro calls gpuos_await),
    so that its call through the jump table and what it does before its wait overlap its
    producers; a Program adds the settled bits."""
    if len(inputs) > MAX_INPUTS or len(scalars) > MAX_SCALARS:
        raise TensorSpecError(
            f"a task takes at most {MAX_INPUTS} inputs and {MAX_SCALARS} "
            f"scalars, got {len(inputs)} and {len(scalars)}"
        )
    refs = tensor_fields(out) + sum((tensor_fields(x) for x in inputs), ())
    refs += _NO_TENSOR * (MAX_INPUTS - len(inputs))
    scalars = tuple(scalars) + (0.0,) * (MAX_SCALARS - len(scalars))
    raw = records[: len(ranges)].view(np.uint8).reshape(len(ranges), TASK.itemsize)
    begin, end = ranges[0]
    TASK_STRUCT.pack_into(
        raw[0],
        0,
        0,
        len(inputs),
        TASK_EARLY,
        reduce_mask,
        NO_EVENT,
        begin,
        end,
        *scalars,
        *_NO_DEPS,
        *refs,
    )
    if len(ranges) > 1:  # the records differ only in their ranges: copy bytes, set two columns
        raw[1:] = raw[0]
        bounds = np.asarray(ranges, dtype=np.int64)
        records["range_begin"][: len(ranges)] = bounds[:, 0]
        records["range_end"][: len(ranges)] = bounds[:, 1]


def ref_shape(ref: np.void) -> tuple[int, ...]:
    """Sizes of an encoded tensor."""
    return tuple(int(s) for s in ref["sizes"][: int(ref["ndim"])])


def ref_strides(ref: np.void) -> tuple[int, ...]:
    """Strides (in elements) of an encoded tensor."""
    return tuple(int(s) for s in ref["strides"][: int(ref["ndim"])])


def encode_ref(tensor: torch.Tensor) -> bytes:
    """`tensor` as one packed TENSOR_REF (where a workspace carries a tensor beside the inputs)."""
    return REF_STRUCT.pack(*tensor_fields(tensor))


def decode_ref(ref: np.void) -> torch.Tensor:
    """A tensor viewing the host memory an encoded TensorRef describes (no copy): how the CPU
    backend reads the tensors of a record."""
    dtype = CODE_DTYPES[int(ref["dtype"])]
    shape, strides = ref_shape(ref), ref_strides(ref)
    if int(ref["numel"]) == 0:
        return torch.empty(shape, dtype=dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (span * itemsize)).from_address(int(ref["data"]))
    return torch.frombuffer(buf, dtype=dtype, count=span).as_strided(shape, strides)
