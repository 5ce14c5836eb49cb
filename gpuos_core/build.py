"""`python -m gpuos_core.build`: compile every CUDA source and catalogue operator and link them into
a worker image, one line per unit. Warms the JIT cache before a deployment, and shows in CI that
everything builds on a machine without a GPU (NVRTC and nvJitLink need none).

Units compile in parallel processes, one a core by default: a serial build of the 53 units took
233 s on a 2-core machine, past what a first deployment or CI should wait."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .image import image_units
from .jit import (
    DEFAULT_ARCH,
    CompileSpec,
    JitCache,
    compile_object,
    link_image,
    stats,
    supported_archs,
)
from .optable import OpVersion, catalogue_table
from .runtime import local_arch


def catalogue_slots() -> tuple[OpVersion, ...]:
    """Version 1 of every catalogue operator, as a fresh runtime loads them."""
    return catalogue_table().slots()


def compile_unit(unit: CompileSpec, cache: JitCache) -> tuple[bytes, str, float]:
    """`unit`'s object, whether the cache answered ("cached") or NVRTC ran ("compiled"), and ms."""
    hits, started = stats.cache_hits, time.perf_counter()
    data = compile_object(unit, cache)
    how = "cached" if stats.cache_hits > hits else "compiled"
    return data, how, 1e3 * (time.perf_counter() - started)


def build(arch: str, cache: JitCache, jobs: int, trace: bool = False) -> int:
    """Compile (`jobs` processes) and link the catalogue image for `arch` (its traced units when
    `trace`), printing each unit in image order; returns image bytes."""
    units = list(image_units(catalogue_slots(), arch, trace))
    label = f"{arch} traced" if trace else arch  # what each line starts with
    objects = []
    # spawn, not fork: the parent has initialized CUDA (local_arch) and may run torch's threads.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        done = pool.map(compile_unit, units, [cache] * len(units))
        for unit, (data, how, ms) in zip(units, done, strict=True):
            objects.append((unit.name, data))
            print(f"{label}  {unit.name:<34} {how:<8} {len(data):>8} B  {ms:7.1f} ms", flush=True)
    started = time.perf_counter()
    image = link_image(objects, arch)
    print(
        f"{label}  linked image of {len(objects)} units: {len(image)} B in "
        f"{1e3 * (time.perf_counter() - started):.1f} ms"
    )
    return len(image)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--arch",
        action="append",
        choices=supported_archs(),
        help=f"target (repeatable; default: this machine's GPU's, else {DEFAULT_ARCH})",
    )
    parser.add_argument("--cache-dir", type=Path, help="JIT cache (default ~/.cache/gpuos/jit)")
    cores = len(os.sched_getaffinity(0))
    parser.add_argument(
        "--jobs", type=int, default=cores, help=f"compiling processes (default {cores}, the cores)"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="the traced units instead (CudaConfig(trace=True): what bench/step_trace.py runs)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs takes a count of at least 1")
    cache = JitCache(args.cache_dir)
    for arch in args.arch or [local_arch() or DEFAULT_ARCH]:
        build(arch, cache, args.jobs, args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
