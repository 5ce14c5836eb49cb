"""Every CUDA source and catalogue operator compiles with NVRTC and links into one worker image
(no GPU needed); images hold the current and previous version of a swapped operator."""

from __future__ import annotations

import pytest
from test_jit import ARCHS

from gpuos_core.build import catalogue_slots
from gpuos_core.catalogue import CATALOGUE, expression_spec, new_version
from gpuos_core.image import build_image, jump_table_source
from gpuos_core.jit import JitCache
from gpuos_core.optable import OpTable

ELF_EXECUTABLE = 2  # e_type of a linked cubin (objects are 1, relocatable)


@pytest.fixture(scope="module")
def cache() -> JitCache:
    return JitCache()  # the user's cache: keys are content hashes, so it is never stale


def assert_linked_image(image: bytes, symbols: list[str]) -> None:
    assert image[:4] == b"\x7fELF"
    assert int.from_bytes(image[16:18], "little") == ELF_EXECUTABLE
    for symbol in ["gpuos_worker", "gpuos_write_u64", "gpuos_jump_table", *symbols]:
        assert symbol.encode() in image, f"{symbol} missing from the image"


def test_the_whole_catalogue_links_into_one_image(cache: JitCache) -> None:
    slots = catalogue_slots()
    assert {v.name for v in slots} == set(CATALOGUE)
    assert_linked_image(build_image(slots, "sm_90", cache).binary, [v.symbol for v in slots])


def test_an_image_holds_current_and_previous_of_swapped_operators(cache: JitCache) -> None:
    table, _ = OpTable().added(expression_spec("fma", "A * B + C"))
    table, _ = table.added(CATALOGUE["gelu"])
    table, v2 = table.swapped(new_version(table.current("fma").spec, "A * B + C * 0.5"))
    table, g2 = table.swapped(new_version(table.current("gelu").spec, "gelu_tanh(A)"))
    slots = table.slots()
    assert [v.symbol for v in slots] == [
        "gpuos_op_fma_v1",
        "gpuos_op_fma_v2",
        "gpuos_op_gelu_v1",
        "gpuos_op_gelu_v2",
    ]
    assert jump_table_source(slots).count("gpuos_op_") == 2 * len(slots)  # declared and listed
    assert_linked_image(build_image(slots, "sm_90", cache).binary, [v.symbol for v in slots])


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm_90"])
def test_other_architectures_link(cache: JitCache, arch: str) -> None:
    # the operators with instructions that need sm_80 (their tensor-core paths) among them
    names = {"mul", "softmax", "attention_decode", "linear", "sample_tokens"}
    slots = [v for v in catalogue_slots() if v.name in names]
    assert_linked_image(build_image(slots, arch, cache).binary, [v.symbol for v in slots])


def test_a_traced_image_carries_the_trace_tables(cache: JitCache) -> None:
    """CudaConfig.trace builds every unit with GPUOS_TRACE: the tables CudaBackend.trace reads
    exist in that image only, so a serving image pays nothing for them."""
    slots = [v for v in catalogue_slots() if v.name in {"add", "attention_decode", "linear"}]
    tables = ["gpuos_trace", "gpuos_trace_marks", "gpuos_trace_ticket"]
    assert_linked_image(build_image(slots, "sm_90", cache, trace=True).binary, tables)
    assert b"gpuos_trace" not in build_image(slots, "sm_90", cache).binary
