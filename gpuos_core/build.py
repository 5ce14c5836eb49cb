"""`python -m gpuos_core.build`: compile every CUDA source and catalogue operator and link them into
a worker image, one line per unit. Warms the JIT cache before a deployment, and shows in CI that
everything builds on a machine without a GPU (NVRTC and nvJitLink need none).

Units compile on a thread a core by default (jit.compile_objects)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .image import image_units
from .jit import DEFAULT_ARCH, JitCache, compile_objects, cores, link_image, supported_archs
from .optable import OpVersion, catalogue_table
from .runtime import local_arch


def catalogue_slots() -> tuple[OpVersion, ...]:
    """Version 1 of every catalogue operator, as a fresh runtime loads them."""
    return catalogue_table().slots()


def build(arch: str, cache: JitCache, jobs: int) -> int:
    """Compile (on `jobs` threads) and link the catalogue image for `arch`, printing each unit in
    image order; returns image bytes."""
    objects = []
    for c in compile_objects(image_units(catalogue_slots(), arch), cache, jobs):
        how = "cached" if c.cached else "compiled"
        print(f"{arch}  {c.spec.name:<34} {how:<8} {len(c.data):>8} B  {c.ms:7.1f} ms", flush=True)
        objects.append((c.spec.name, c.data))
    started = time.perf_counter()
    image = link_image(objects, arch)
    print(
        f"{arch}  linked image of {len(objects)} units: {len(image)} B in "
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
    here = cores()
    parser.add_argument(
        "--jobs", type=int, default=here, help=f"compiling threads (default {here}, the cores)"
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs takes a count of at least 1")
    cache = JitCache(args.cache_dir)
    for arch in args.arch or [local_arch() or DEFAULT_ARCH]:
        build(arch, cache, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
