"""`python -m gpuos_core.build`: compile every CUDA source and catalogue operator and link them into
a worker image, one line per unit. Warms the JIT cache before a deployment, and shows in CI that
everything builds on a machine without a GPU (NVRTC and nvJitLink need none)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .image import image_units
from .jit import DEFAULT_ARCH, JitCache, compile_object, link_image, stats, supported_archs
from .optable import OpVersion, catalogue_table
from .runtime import local_arch


def catalogue_slots() -> tuple[OpVersion, ...]:
    """Version 1 of every catalogue operator, as a fresh runtime loads them."""
    return catalogue_table().slots()


def build(arch: str, cache: JitCache) -> int:
    """Compile and link the catalogue image for `arch`, printing each unit; returns image bytes."""
    objects = []
    for unit in image_units(catalogue_slots(), arch):
        hits, started = stats.cache_hits, time.perf_counter()
        objects.append((unit.name, compile_object(unit, cache)))
        how = "cached" if stats.cache_hits > hits else "compiled"
        ms = 1e3 * (time.perf_counter() - started)
        print(f"{arch}  {unit.name:<34} {how:<8} {len(objects[-1][1]):>8} B  {ms:7.1f} ms")
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
    args = parser.parse_args(argv)
    cache = JitCache(args.cache_dir)
    for arch in args.arch or [local_arch() or DEFAULT_ARCH]:
        build(arch, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
