"""NVRTC JIT: compile CUDA translation units to relocatable cubins, cache them, link images.

Every operator version is compiled on its own with `-rdc=true` and linked into the worker image;
it is never loaded as a module of its own (docs/DESIGN.md, runtime protocol 2). A `CompileSpec`
describes one artifact (FlashInfer-style); `compile_object` is try-load / build / store over a
`JitCache`, `compile_objects` the same for many on threads (NVRTC lets the GIL go); `link_image`
links objects with nvJitLink. NVRTC and nvJitLink need no GPU, so all
of this runs in CI.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda.bindings import nvjitlink, nvrtc

from gpuos_core.errors import CompileError, LinkError
from gpuos_core.paths import CUDA_DIR, cache_dir

# The oldest compute capability the device code builds for: NVRTC 13's oldest target. On sm_75
# (T4) the operators take their CUDA-core paths: mma.sync m16n8k16, cp.async and bf16 conversion
# instructions need sm_80 (GPUOS_SM80 in gpuos_device.cuh).
MIN_ARCH = 75
# Arch-specific targets the device code uses the instructions of, by the base target they
# extend: sm_90a has warpgroup products (wgmma), which the linear's 64-row m-blocks run on
# (GPUOS_WGMMA in gpuos_device.cuh). Its objects load only on compute capability 9.0.
_SPECIFIC = {"sm_90": "sm_90a"}
DEFAULT_ARCH = "sm_90"  # the target when there is no device to ask (CI, the CPU backend)
# -rdc=true: objects must link into one image. -default-device: header helpers that carry no
# execution-space annotation compile for the device (NVRTC has no host side to compile them for).
# --maxrregcount=128: the linked worker takes the register count of its hungriest operator (it
# can call any of them); uncapped that was 203 on sm_90, which blocks torch's kernels from
# co-running. At 64, attention and linear spilled 2 KB and 1 KB a thread (the H200 decode step
# 8-20% slower than at 96); 128 against 96 took the traced H200 step 2.6-5% faster and the 64-row
# linears 7-14% (bench/NOTES.md, s191-s192). A 256-thread worker block then holds 32K of an SM's
# 64K registers: the swap canary's second worker still fits beside it.
_BASE_OPTIONS = ("-rdc=true", "-std=c++17", "-default-device", "--maxrregcount=128")
_HEADER_SUFFIXES = frozenset({".h", ".cuh", ".hpp"})
_DIGEST_SIZE = hashlib.sha256().digest_size
_NVRTC_OK = nvrtc.nvrtcResult.NVRTC_SUCCESS

log = logging.getLogger("gpuos.jit")


@dataclass
class JitStats:
    """Process-wide JIT counters, for metrics and tests (counted under `_counting`: units compile
    on several threads)."""

    compiles: int = 0  # NVRTC compilations that produced an object
    cache_hits: int = 0  # compile_object calls answered from a JitCache


stats = JitStats()
_counting = threading.Lock()


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library loaded in this process."""
    major, minor = _check_nvrtc(nvrtc.nvrtcVersion(), None, "querying the NVRTC version")
    return major, minor


@functools.cache
def supported_archs() -> tuple[str, ...]:
    """Every target this process's NVRTC compiles for, from MIN_ARCH up, oldest first."""
    archs = _check_nvrtc(nvrtc.nvrtcGetSupportedArchs(), None, "querying NVRTC's targets")
    base = [f"sm_{a}" for a in sorted(archs) if a >= MIN_ARCH]
    return tuple(a for arch in base for a in (arch, _SPECIFIC.get(arch)) if a is not None)


def device_arch(major: int, minor: int) -> str | None:
    """The target for a device of compute capability major.minor: its own (arch-specific where
    the device code uses that target's instructions), or None when this device code cannot be
    built for it (older than MIN_ARCH, or newer than NVRTC knows)."""
    arch = f"sm_{major}{minor}"
    return _SPECIFIC.get(arch, arch) if arch in supported_archs() else None


def _validate_arch(arch: str) -> None:
    """Raise ValueError unless `arch` is one the runtime builds for."""
    if arch not in supported_archs():
        raise ValueError(
            f"unsupported arch {arch!r}: this NVRTC builds {', '.join(supported_archs())}"
        )


def _update(digest: Any, *parts: bytes) -> None:
    """Feed length-prefixed parts into a hash, so that different part lists never hash alike."""
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


@functools.cache
def _headers_digest(cuda_dir: Path) -> bytes:
    """sha256 over the relative path and content of every header under `cuda_dir`.

    Any header can be #included, directly or transitively, so all of them enter every key. Read
    once per process: headers are part of the installed code, not edited while it runs.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in cuda_dir.rglob("*") if p.suffix in _HEADER_SUFFIXES):
        _update(digest, path.relative_to(cuda_dir).as_posix().encode(), path.read_bytes())
    return digest.digest()


@dataclass(frozen=True)
class CompileSpec:
    """One compiled artifact: a whole translation unit and how to compile it."""

    name: str  # unit name shown in logs and NVRTC messages, e.g. "gpuos_op_relu_v1"
    source: str  # the whole translation unit; may #include headers under CUDA_DIR
    arch: str = DEFAULT_ARCH  # one of supported_archs()
    options: tuple[str, ...] = ()  # extra NVRTC options, placed after the base ones

    def __post_init__(self) -> None:
        _validate_arch(self.arch)
        # A list would make the spec unhashable.
        object.__setattr__(self, "options", tuple(self.options))

    def nvrtc_options(self) -> list[str]:
        """The full NVRTC command line for this unit."""
        arch = f"--gpu-architecture={self.arch}"
        return [arch, *_BASE_OPTIONS, f"-I{CUDA_DIR}", *self.options]

    def key(self) -> str:
        """sha256 hex of all that determines the object: source, headers, options, arch, NVRTC.

        The include path itself is left out, so moving the checkout keeps the cache valid.
        """
        digest = hashlib.sha256()
        version = "{}.{}".format(*nvrtc_version())
        _update(digest, self.source.encode(), _headers_digest(CUDA_DIR))
        _update(digest, self.arch.encode(), version.encode())
        _update(digest, *(option.encode() for option in (*_BASE_OPTIONS, *self.options)))
        return digest.hexdigest()


class JitCache:
    """On-disk cache of relocatable cubins, one file per `CompileSpec.key()`.

    A file holds the sha256 of its payload, then the payload: a truncated or damaged file is
    detected, deleted and rebuilt instead of reaching the linker. Writes are atomic (temp file in
    the same directory, then os.replace), so concurrent processes never read a half-written file.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_dir() / "jit"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, spec: CompileSpec) -> Path:
        """The file that holds (or would hold) `spec`'s object."""
        return self.root / f"{spec.key()}.bin"

    def try_load(self, spec: CompileSpec) -> bytes | None:
        """`spec`'s cached object, or None when absent or corrupt (a corrupt file is deleted)."""
        path = self.path(spec)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        checksum, data = blob[:_DIGEST_SIZE], blob[_DIGEST_SIZE:]
        if data and hashlib.sha256(data).digest() == checksum:
            return data
        log.warning("deleting corrupt JIT cache file %s (unit %s); rebuilding", path, spec.name)
        path.unlink(missing_ok=True)
        return None

    def store(self, spec: CompileSpec, data: bytes) -> None:
        """Atomically write `data` as `spec`'s object, replacing any previous file."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".bin")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(hashlib.sha256(data).digest() + data)
            os.replace(tmp, self.path(spec))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def compile_object(spec: CompileSpec, cache: JitCache | None = None) -> bytes:
    """`spec`'s relocatable cubin: from `cache` when it holds a valid copy, else compiled, stored.

    With `cache=None` every call compiles. Raises CompileError (with NVRTC's log) when NVRTC fails.
    """
    return _object(spec, cache).data


@dataclass(frozen=True)
class Compiled:
    """One unit's object, whether the cache held it, and the milliseconds it took."""

    spec: CompileSpec
    data: bytes
    cached: bool
    ms: float


def compile_objects(
    specs: Sequence[CompileSpec], cache: JitCache | None = None, jobs: int | None = None
) -> Iterator[Compiled]:
    """Each spec's object as `compile_object` makes it, in order, compiled on `jobs` threads
    (default: this process's cores). NVRTC lets the GIL go, so the units of an image compile side
    by side: the catalogue's 53 took 233 s one after another on a 2-core machine. The first
    CompileError, in order, is raised when its unit is reached."""
    workers = jobs or cores()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpuos-nvrtc")
    try:
        yield from pool.map(lambda spec: _object(spec, cache), specs)
    finally:  # after an error, or a caller that stops early: no unit compiled for nothing
        pool.shutdown(cancel_futures=True)


def cores() -> int:
    """The cores this process may run on (all of the machine's where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _object(spec: CompileSpec, cache: JitCache | None) -> Compiled:
    started = time.perf_counter()
    cached = cache.try_load(spec) if cache is not None else None
    if cached is not None:
        with _counting:
            stats.cache_hits += 1
        return Compiled(spec, cached, True, 1e3 * (time.perf_counter() - started))
    data = _nvrtc_compile(spec)
    if cache is not None:
        cache.store(spec, data)
    return Compiled(spec, data, False, 1e3 * (time.perf_counter() - started))


def _nvrtc_compile(spec: CompileSpec) -> bytes:
    """Compile `spec` with NVRTC into a relocatable cubin."""
    start = time.perf_counter()
    what = f"compiling {spec.name} for {spec.arch}"
    created = nvrtc.nvrtcCreateProgram(spec.source.encode(), f"{spec.name}.cu".encode(), 0, [], [])
    prog = _check_nvrtc(created, None, what)
    try:
        options = [option.encode() for option in spec.nvrtc_options()]
        _check_nvrtc(nvrtc.nvrtcCompileProgram(prog, len(options), options), prog, what)
        cubin = bytearray(_check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), prog, what))
        _check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), prog, what)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    with _counting:
        stats.compiles += 1
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    log.debug("compiled %s for %s in %.1f ms", spec.name, spec.arch, elapsed_ms)
    return bytes(cubin)


def _check_nvrtc(result: tuple[Any, ...], prog: Any, what: str) -> Any:
    """The NVRTC chokepoint: unpack an `(status, *values)` result, or raise CompileError.

    Returns None, the one value, or the tuple of values. The error carries the program's log when
    there is a program (`prog` not None).
    """
    status, *values = result
    if status != _NVRTC_OK:
        reason = nvrtc.nvrtcGetErrorString(status)[1].decode()
        hint = "; fix the source at the lines the log names" if prog is not None else ""
        compile_log = _nvrtc_log(prog) if prog is not None else ""
        raise CompileError(f"{what} failed: {reason}{hint}", compile_log)
    return values[0] if len(values) == 1 else tuple(values) or None


def _nvrtc_log(prog: Any) -> str:
    """The program's compile log, or "" when it cannot be read (never hide the first error)."""
    status, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if status != _NVRTC_OK:
        return ""
    buffer = bytearray(size)  # bytearray: NVRTC writes into it (never into an immutable bytes)
    if nvrtc.nvrtcGetProgramLog(prog, buffer)[0] != _NVRTC_OK:
        return ""
    return buffer.rstrip(b"\0").decode(errors="replace")


def link_image(objects: Sequence[tuple[str, bytes]], arch: str = DEFAULT_ARCH) -> bytes:
    """Link relocatable cubins, given as (name, data), into one executable cubin for `arch`.

    Raises ValueError for an empty list or an empty object, LinkError (with nvJitLink's error log,
    which names e.g. an unresolved symbol) when linking fails.
    """
    _validate_arch(arch)
    _validate_objects(objects)
    start = time.perf_counter()
    with _check_nvjitlink(0, f"creating an nvJitLink handle for {arch}"):
        handle = nvjitlink.create(1, [f"-arch={arch}"])
    try:
        names = ", ".join(name for name, _ in objects)
        with _check_nvjitlink(handle, f"linking {names} for {arch}"):
            for name, data in objects:
                nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, data, len(data), name)
            nvjitlink.complete(handle)
            image = bytearray(nvjitlink.get_linked_cubin_size(handle))
            nvjitlink.get_linked_cubin(handle, image)
    finally:
        nvjitlink.destroy(handle)
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    log.debug("linked %d objects for %s in %.1f ms", len(objects), arch, elapsed_ms)
    return bytes(image)


def _validate_objects(objects: Sequence[tuple[str, bytes]]) -> None:
    """Reject inputs nvJitLink would only answer with a bare ERROR_INVALID_INPUT."""
    if not objects:
        raise ValueError("link_image needs at least one object")
    for name, data in objects:
        if not data:
            raise ValueError(f"object {name!r} is empty: pass the bytes compile_object returned")


@contextmanager
def _check_nvjitlink(handle: int, what: str) -> Iterator[None]:
    """The nvJitLink chokepoint: turn nvJitLinkError into LinkError with the handle's error log.

    `handle` 0 means there is no handle yet (creation failed), so no log."""
    try:
        yield
    except nvjitlink.nvJitLinkError as error:
        link_log = _nvjitlink_log(handle) if handle else ""
        raise LinkError(f"{what} failed: {error}", link_log) from error


def _nvjitlink_log(handle: int) -> str:
    """The handle's error log, or "" when it cannot be read (never hide the first error)."""
    try:
        buffer = bytearray(nvjitlink.get_error_log_size(handle))
        nvjitlink.get_error_log(handle, buffer)
    except nvjitlink.nvJitLinkError:
        return ""
    return buffer.rstrip(b"\0").decode(errors="replace")
