"""Worker images: the translation unit of each operator version, the generated jump table, and
the link of worker + operators + table into one cubin (docs/DESIGN.md, runtime protocol 2 and 3).

Only glue is generated here, from data: the instantiation of a family macro with a version's
symbol, an expression functor, and the jump table. Every kernel body lives in cuda/.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tqdm import tqdm

from .jit import DEFAULT_ARCH, CompileSpec, JitCache, compile_object, compile_objects, link_image
from .optable import OpVersion
from .paths import CUDA_DIR

WORKER_SOURCE = "gpuos_worker.cu"


def op_source(v: OpVersion) -> str:
    """Translation unit defining `v.symbol` as a device function of the GpuosOpFn signature."""
    fam = v.spec.kind
    lines = [f'#include "{fam.header}"']
    if v.spec.expression is None:
        return "\n".join(lines + [f"{fam.macro}({v.symbol})", ""])
    return "\n".join(
        lines
        + [
            '#include "ops/math.cuh"',
            "namespace {",
            "struct Fn {",
            "  __device__ float operator()(const float* a, const float* s) const {",
            v.spec.cuda_body or f"    return {v.spec.expression.cuda};",
            "  }",
            "};",
            "}  // namespace",
            f"{fam.macro}({v.symbol}, Fn, {v.spec.arity})",
            "",
        ]
    )


def jump_table_source(slots: Sequence[OpVersion]) -> str:
    """Translation unit defining the jump table: slot i calls slots[i]."""
    decls = [f'extern "C" __device__ void {v.symbol}(const GpuosTask*);' for v in slots]
    entries = ", ".join(v.symbol for v in slots) or "0"
    return "\n".join(
        [
            '#include "gpuos_abi.h"',
            *decls,
            f'extern "C" __device__ GpuosOpFn gpuos_jump_table[] = {{{entries}}};',
            f'extern "C" __device__ int gpuos_jump_table_size = {len(slots)};',
            "",
        ]
    )


def version_unit(v: OpVersion, arch: str = DEFAULT_ARCH) -> CompileSpec:
    """The compile unit of one operator version."""
    return CompileSpec(v.symbol, op_source(v), arch)


def image_units(
    slots: Sequence[OpVersion], arch: str = DEFAULT_ARCH, trace: bool = False
) -> list[CompileSpec]:
    """Every unit an image of `slots` links: the worker, each version, the jump table; all
    compiled to record per-record times when `trace` (CudaConfig.trace)."""
    worker = CompileSpec("gpuos_worker", (CUDA_DIR / WORKER_SOURCE).read_text(), arch)
    table = CompileSpec("gpuos_jump_table", jump_table_source(slots), arch)
    units = [worker, *(version_unit(v, arch) for v in slots), table]
    # every unit: operators mark their phases too (GPUOS_MARK in gpuos_device.cuh)
    return [replace(u, options=u.options + ("-DGPUOS_TRACE=1",)) for u in units] if trace else units


def compile_version(v: OpVersion, arch: str = DEFAULT_ARCH, cache: JitCache | None = None) -> bytes:
    """Relocatable cubin of one operator version (cached); CompileError carries the NVRTC log."""
    return compile_object(version_unit(v, arch), cache)


@dataclass(frozen=True)
class ImageBuild:
    """A linked image and what it cost."""

    binary: bytes  # the cubin to load
    compile_ms: float  # compiling (or loading from cache) every unit
    link_ms: float  # nvJitLink


def build_image(
    slots: Sequence[OpVersion],
    arch: str = DEFAULT_ARCH,
    cache: JitCache | None = None,
    trace: bool = False,
) -> ImageBuild:
    """Link the worker, every version in `slots` and their jump table into one cubin."""
    started = time.perf_counter()
    # A bar only when compiling takes a while (a replica's first start, not cache hits or swaps).
    units = image_units(slots, arch, trace)
    done = tqdm(
        compile_objects(units, cache),
        desc="gpuos: compiling operators",
        total=len(units),
        unit="unit",
        delay=2.0,
        leave=False,
    )
    objects = [(c.spec.name, c.data) for c in done]
    compiled = time.perf_counter()
    binary = link_image(objects, arch)
    return ImageBuild(binary, 1e3 * (compiled - started), 1e3 * (time.perf_counter() - compiled))
