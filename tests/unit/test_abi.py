"""The Python mirror of cuda/gpuos_abi.h agrees with the C header byte for byte.

The host C compiler prints sizeof/offsetof of every field of the header's structs; the numpy dtypes
in gpuos_core.abi must give the same numbers (and the same constants)."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch

from gpuos_core import abi
from gpuos_core.paths import CUDA_DIR

CC = shutil.which("cc") or shutil.which("gcc")


def _c_program(fields: dict[str, list[str]]) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        '#include "gpuos_abi.h"',
        "int main(void) {",
        'printf("{");',
    ]
    for struct, names in fields.items():
        lines.append(f'printf("\\"{struct}\\": %zu, ", sizeof({struct}));')
        lines += [f'printf("\\"{struct}.{n}\\": %zu, ", offsetof({struct}, {n}));' for n in names]
    for const in (
        "GPUOS_ABI_VERSION",
        "GPUOS_MAX_DIMS",
        "GPUOS_MAX_INPUTS",
        "GPUOS_MAX_SCALARS",
        "GPUOS_DTYPE_F32",
        "GPUOS_DTYPE_F16",
        "GPUOS_DTYPE_BF16",
        "GPUOS_DYNAMIC_SMEM",
        "GPUOS_TASK_SETTLED(1)",
    ):
        lines.append(f'printf("\\"{const}\\": %d, ", (int){const});')
    lines += ['printf("\\"end\\": 0}");', "return 0; }"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    if CC is None:
        pytest.skip("no host C compiler")
    tmp = tmp_path_factory.mktemp("abi")
    fields = {
        "GpuosTensorRef": list(abi.TENSOR_REF.names),
        "GpuosTask": list(abi.TASK.names),
        "GpuosQueue": list(abi.QUEUE.names),
    }
    (tmp / "layout.c").write_text(_c_program(fields))
    subprocess.run(
        [CC, "-std=c99", "-Wall", "-Werror", f"-I{CUDA_DIR}", "layout.c", "-o", "layout"],
        cwd=tmp,
        check=True,
    )
    return json.loads(
        subprocess.run([str(tmp / "layout")], capture_output=True, text=True, check=True).stdout
    )


@pytest.mark.parametrize(
    "struct,dtype",
    [("GpuosTensorRef", abi.TENSOR_REF), ("GpuosTask", abi.TASK), ("GpuosQueue", abi.QUEUE)],
)
def test_struct_layout_matches_header(
    c_layout: dict[str, int], struct: str, dtype: np.dtype
) -> None:
    assert dtype.itemsize == c_layout[struct]
    for name in dtype.names:
        assert dtype.fields[name][1] == c_layout[f"{struct}.{name}"], name


def test_constants_match_header(c_layout: dict[str, int]) -> None:
    assert c_layout["GPUOS_ABI_VERSION"] == abi.ABI_VERSION
    assert c_layout["GPUOS_MAX_DIMS"] == abi.MAX_DIMS
    assert c_layout["GPUOS_MAX_INPUTS"] == abi.MAX_INPUTS
    assert c_layout["GPUOS_MAX_SCALARS"] == abi.MAX_SCALARS
    assert c_layout["GPUOS_DTYPE_F32"] == abi.DTYPE_CODES[torch.float32]
    assert c_layout["GPUOS_DTYPE_F16"] == abi.DTYPE_CODES[torch.float16]
    assert c_layout["GPUOS_DTYPE_BF16"] == abi.DTYPE_CODES[torch.bfloat16]
    assert c_layout["GPUOS_DYNAMIC_SMEM"] == abi.DYNAMIC_SMEM
    assert c_layout["GPUOS_TASK_SETTLED(1)"] == abi.task_settled(1)


def test_encode_task_records_view_geometry_read_back_through_the_dtype() -> None:
    base = torch.randn(4, 6, dtype=torch.float16)
    view = base[1:, ::2].t()  # non-contiguous, offset view
    other = torch.zeros(3, 3, dtype=torch.bfloat16)
    records = np.zeros(2, dtype=abi.TASK)
    abi.encode_task(records, [(0, 5), (5, 9)], view, (other, view), (0.5, -2.0), reduce_mask=2)
    for record, (begin, end) in zip(records, [(0, 5), (5, 9)]):
        assert (int(record["range_begin"]), int(record["range_end"])) == (begin, end)
        assert int(record["num_inputs"]) == 2 and int(record["reduce_mask"]) == 2
        assert list(record["scalars"]) == [0.5, -2.0, 0.0, 0.0]
        out, first, unused = record["out"], record["in"][0], record["in"][2]
        assert abi.ref_shape(out) == (3, 3) and abi.ref_strides(out) == (2, 6)
        assert int(out["data"]) == view.data_ptr() == base.data_ptr() + 2 * 6
        assert int(out["dtype"]) == abi.DTYPE_CODES[torch.float16] and int(out["numel"]) == 9
        assert int(first["data"]) == other.data_ptr()
        assert int(first["dtype"]) == abi.DTYPE_CODES[torch.bfloat16]
        assert list(first["sizes"]) == [3, 3, 1, 1, 1, 1] and list(first["strides"]) == [
            3,
            1,
            0,
            0,
            0,
            0,
        ]
        assert int(unused["data"]) == 0 and int(unused["ndim"]) == 0


def test_encode_rejects_unsupported_tensors() -> None:
    records = np.zeros(1, dtype=abi.TASK)
    with pytest.raises(abi.TensorSpecError, match="float64 is not supported"):
        abi.encode_task(records, [(0, 2)], torch.zeros(2, dtype=torch.float64), ())
    with pytest.raises(abi.TensorSpecError, match="7 dims"):
        abi.encode_task(records, [(0, 1)], torch.zeros((1,) * 7), ())
