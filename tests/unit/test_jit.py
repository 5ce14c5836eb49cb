"""The NVRTC JIT: real compiles, real links, a real on-disk cache in a fresh directory per test."""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuos_core import jit
from gpuos_core.errors import CompileError, LinkError
from gpuos_core.jit import (
    CompileSpec,
    JitCache,
    compile_object,
    compile_objects,
    device_arch,
    link_image,
    supported_archs,
)

# Two units that only link together: the kernel calls a device function defined in the other one.
SQUARE = CompileSpec(
    "gpuos_test_square",
    'extern "C" __device__ float gpuos_test_square(float x) { return x * x + 1.0f; }\n',
)
KERNEL = CompileSpec(
    "gpuos_test_kernel",
    'extern "C" __device__ float gpuos_test_square(float x);\n'
    'extern "C" __global__ void gpuos_test_kernel(float* p) {\n'
    "  p[threadIdx.x] = gpuos_test_square(p[threadIdx.x]);\n"
    "}\n",
)
ET_REL, ET_EXEC = 1, 2  # ELF e_type of a relocatable object and of a linked executable
# Targets the tests build for: T4, A100, A10G/RTX 30, L4/RTX 40, H100/H200, B200, RTX 50.
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")


def elf_type_and_sm(blob: bytes) -> tuple[int, int]:
    """(e_type, SM number) of a cubin; CUDA's ELF ABI v8 keeps the SM in bits 8-15 of e_flags."""
    assert blob[:4] == b"\x7fELF", "not an ELF file"
    (e_type,) = struct.unpack_from("<H", blob, 16)
    (e_flags,) = struct.unpack_from("<I", blob, 48)
    return e_type, (e_flags >> 8) & 0xFF


@pytest.fixture
def cache(tmp_path: Path) -> JitCache:
    return JitCache(tmp_path / "jit")


@pytest.mark.parametrize("arch", ARCHS)
def test_units_compile_and_link_into_one_executable_cubin(arch: str) -> None:
    square = compile_object(dataclasses.replace(SQUARE, arch=arch))
    kernel = compile_object(dataclasses.replace(KERNEL, arch=arch))
    image = link_image([("square", square), ("kernel", kernel)], arch)
    sm = int(arch.removeprefix("sm_").removesuffix("a"))  # sm_90a: an sm_90 object
    assert elf_type_and_sm(square) == elf_type_and_sm(kernel) == (ET_REL, sm)
    assert elf_type_and_sm(image) == (ET_EXEC, sm)
    assert b"gpuos_test_kernel" in image


def test_units_find_the_abi_header_on_the_include_path() -> None:
    source = (
        '#include "gpuos_abi.h"\n'
        'extern "C" __device__ void gpuos_test_op(const GpuosTask* task) {\n'
        "  float* out = (float*)task->out.data;\n"
        "  for (int64_t i = task->range_begin + threadIdx.x; i < task->range_end;\n"
        "       i += blockDim.x)\n"
        "    out[i] = task->scalars[0];\n"
        "}\n"
    )
    assert elf_type_and_sm(compile_object(CompileSpec("gpuos_test_op", source)))[0] == ET_REL


def test_cache_hit_returns_identical_bytes_without_compiling(cache: JitCache) -> None:
    compiles = jit.stats.compiles
    built = compile_object(SQUARE, cache)
    assert jit.stats.compiles == compiles + 1
    hits = jit.stats.cache_hits
    # A second JitCache over the same directory stands for the next process.
    assert compile_object(SQUARE, JitCache(cache.root)) == built
    assert (jit.stats.compiles, jit.stats.cache_hits) == (compiles + 1, hits + 1)
    assert list(cache.root.iterdir()) == [cache.path(SQUARE)], "a temp file was left behind"


def test_without_a_cache_every_call_compiles() -> None:
    compiles = jit.stats.compiles
    assert compile_object(SQUARE) == compile_object(SQUARE)
    assert jit.stats.compiles == compiles + 2


@pytest.mark.parametrize(
    "change",
    [
        {"source": SQUARE.source.replace("1.0f", "2.0f")},
        {"options": ("-DGPUOS_TEST=1",)},
        {"arch": "sm_80"},
    ],
    ids=["source", "options", "arch"],
)
def test_key_changes_with_source_options_and_arch(change: dict[str, object]) -> None:
    assert SQUARE.key() == dataclasses.replace(SQUARE).key()
    assert dataclasses.replace(SQUARE, **change).key() != SQUARE.key()


def test_key_changes_when_a_header_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = []
    for version in (1, 2):
        cuda_dir = tmp_path / f"cuda{version}"
        (cuda_dir / "ops").mkdir(parents=True)  # headers in subfolders count too
        (cuda_dir / "ops" / "helper.cuh").write_text(f"#define GPUOS_HELPER {version}\n")
        monkeypatch.setattr(jit, "CUDA_DIR", cuda_dir)
        keys.append(SQUARE.key())
    assert keys[0] != keys[1]


def _truncate(blob: bytes) -> bytes:
    return blob[: len(blob) // 2]


def _flip_last_byte(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 0xFF])


def _empty(blob: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("corrupt", [_truncate, _flip_last_byte, _empty])
def test_corrupt_cache_file_is_rebuilt(
    cache: JitCache, corrupt: Callable[[bytes], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    built = compile_object(SQUARE, cache)
    path = cache.path(SQUARE)
    path.write_bytes(corrupt(path.read_bytes()))
    compiles = jit.stats.compiles
    with caplog.at_level(logging.WARNING, logger="gpuos.jit"):
        assert compile_object(SQUARE, cache) == built
    assert jit.stats.compiles == compiles + 1
    assert any("corrupt" in record.message for record in caplog.records)
    assert cache.try_load(SQUARE) == built, "the rebuilt object was not stored again"


def test_syntax_error_raises_compile_error_with_the_nvrtc_log(cache: JitCache) -> None:
    source = 'extern "C" __device__ float g(float x) {\n  return x +;\n}\n'
    spec = CompileSpec("gpuos_test_broken", source)
    with pytest.raises(CompileError) as raised:
        compile_object(spec, cache)
    assert "gpuos_test_broken" in str(raised.value) and "sm_90" in str(raised.value)
    assert "gpuos_test_broken.cu(2): error" in raised.value.log
    assert cache.try_load(spec) is None, "a failed compile must not be cached"


def test_many_units_compile_side_by_side_in_order_and_say_which_were_cached(
    cache: JitCache,
) -> None:
    units = [dataclasses.replace(SQUARE, arch=arch) for arch in ARCHS[:4]] + [KERNEL]
    compile_object(units[1], cache)
    compiles = jit.stats.compiles
    done = list(compile_objects(units, cache, jobs=2))
    assert [c.spec for c in done] == units
    assert [c.cached for c in done] == [False, True, False, False, False]
    assert jit.stats.compiles == compiles + 4  # the cached one not compiled again
    assert all(c.data == compile_object(c.spec, cache) for c in done)


def test_the_first_failing_unit_of_many_raises_its_compile_error(cache: JitCache) -> None:
    broken = CompileSpec("gpuos_test_broken", 'extern "C" __device__ int f() { return }\n')
    with pytest.raises(CompileError) as raised:
        list(compile_objects([SQUARE, broken, KERNEL], cache, jobs=2))
    assert "gpuos_test_broken" in str(raised.value)


def test_unresolved_extern_raises_link_error_naming_the_symbol() -> None:
    with pytest.raises(LinkError) as raised:
        link_image([("kernel", compile_object(KERNEL))])
    assert "gpuos_test_square" in raised.value.log


def test_unsupported_arch_is_rejected() -> None:
    with pytest.raises(ValueError, match="builds sm_75, sm_80"):
        CompileSpec("gpuos_test_square", SQUARE.source, arch="sm_70")
    with pytest.raises(ValueError, match="builds sm_75, sm_80"):
        link_image([("square", b"\x7fELF")], arch="sm_990")


def test_a_device_gets_its_own_arch_when_the_device_code_builds_for_it() -> None:
    assert set(ARCHS) <= set(supported_archs())
    assert device_arch(8, 6) == "sm_86" and device_arch(12, 0) == "sm_120"
    assert device_arch(9, 0) == "sm_90a", "H100/H200: the 64-row linear's warpgroup products"
    assert device_arch(7, 5) == "sm_75", "T4: CUDA-core paths (no mma m16n8k16, cp.async)"
    assert device_arch(7, 0) is None, "V100: NVRTC 13 builds from sm_75"
    assert device_arch(99, 0) is None, "newer than this NVRTC knows"


def test_only_the_arch_specific_hopper_target_has_warpgroup_products() -> None:
    """The linear's 64-row m-blocks take wgmma where GPUOS_WGMMA says the target has it."""
    source = '#include "gpuos_device.cuh"\n#if !GPUOS_WGMMA\n#error no wgmma\n#endif\n'
    unit = CompileSpec("gpuos_test_wgmma", source, arch="sm_90a")
    assert elf_type_and_sm(compile_object(unit)) == (ET_REL, 90)
    for arch in ("sm_90", "sm_100"):
        with pytest.raises(CompileError, match="no wgmma"):
            compile_object(dataclasses.replace(unit, arch=arch))


def test_empty_link_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one"):
        link_image([])
    with pytest.raises(ValueError, match="'square' is empty"):
        link_image([("square", b"")])
