"""Configuration objects of the runtime and its backends (plain data, no imports of drivers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .jit import DEFAULT_ARCH


@dataclass(frozen=True)
class CudaConfig:
    """Knobs of the CUDA backend (defaults measured on an H100)."""

    # Ring records (a power of two; 672 bytes each, on the device and pinned for staging):
    # bounds records in flight. An LLM step program of four decode steps holds 29k records
    # (GPT-2 small, 64 rows) to 65k (Llama-3.2-1B, 64 rows): the running one and the next must
    # fit, or the next is published in parts as the ring frees, behind the worker (bench/NOTES.md).
    capacity: int = 1 << 17
    block_threads: int = 256  # threads of a worker block (operators need a multiple of 32)
    blocks_per_sm: int = 1  # worker blocks per SM; leaves room for torch's kernels
    idle_us: int = 2000  # a worker block exits after this long without work
    lease_ms: int = 20  # ... and after this long in any case
    stack_bytes: int = 1024  # per-thread stack limit, set once before the first launch
    tile_elements: int = 16384  # records of a large task cover about this many elements each
    max_claim: int = 16  # most records a worker block claims at once (1..16) ...
    program_claim: int = 1  # ... while a dependent program is being published (its
    # tasks' records then spread over every block)
    stall_timeout_s: float = 10.0  # pending records and no completion this long: stalled
    publish_chunk: int = 1024  # records of a batch's first part while the worker has nothing
    # else pending; each later part at most doubles what went before (behind pending work, a
    # part takes all the ring has free)
    spin_s: float = 0.0005  # a waiting thread polls completions itself this long
    poll_sleep_s: float = 2e-4  # the poller thread's pause between polls (a thread waiting
    # on a batch polls itself; this bounds async waits)
    poller_linger_s: float = 0.01  # the poller keeps polling this long after work ran out before
    # it parks (waking a parked poller costs a submit the GIL)
    trace: bool = False  # diagnostics: the worker records when each record was
    # claimed, ready and done (CudaBackend.trace)


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one runtime."""

    backend: str = "auto"  # auto | cuda | cpu
    arch: str = DEFAULT_ARCH  # NVRTC target for operator objects and images
    cache_dir: Path | None = None  # JIT cache (default: $GPUOS_CACHE_DIR/jit or ~/.cache/gpuos/jit)
    drain_timeout_s: float = 30.0  # a swap waits this long for in-flight batches
    allow_raw_cuda: bool = False  # accept operators written as raw CUDA (trusted admins only)
    canary: bool = True  # on a GPU, sandbox-check every new version before activation
    canary_timeout_s: float = 120.0  # the canary child (start-up included) must answer in this
    cuda: CudaConfig = field(default_factory=CudaConfig)  # CUDA backend knobs
