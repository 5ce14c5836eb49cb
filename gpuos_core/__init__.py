"""GPUOS: a persistent-kernel runtime for batched micro-operations (usable without Ray)."""

from .batch import Batch
from .calls import OpCall, Prepared
from .config import CudaConfig, RuntimeConfig
from .dispatch import Scheduler, SchedulerConfig, SchedulerStats, Traced, scheduler, trace
from .errors import (
    BackendUnavailableError,
    CanaryCrashError,
    CanaryMismatchError,
    CompileError,
    ExpressionError,
    GpuosError,
    LinkError,
    OperatorExistsError,
    RawCudaDisabledError,
    RollbackError,
    RuntimeClosedError,
    TaskFailedError,
    TensorSpecError,
    UnknownOperatorError,
    WaitTimeoutError,
)
from .runtime import Runtime
from .tracing import TraceStats

__all__ = [
    "Batch",
    "CudaConfig",
    "OpCall",
    "Prepared",
    "Runtime",
    "RuntimeConfig",
    "BackendUnavailableError",
    "CanaryCrashError",
    "CanaryMismatchError",
    "CompileError",
    "ExpressionError",
    "GpuosError",
    "LinkError",
    "OperatorExistsError",
    "RawCudaDisabledError",
    "RollbackError",
    "RuntimeClosedError",
    "TaskFailedError",
    "TensorSpecError",
    "UnknownOperatorError",
    "WaitTimeoutError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "scheduler",
    "trace",
    "Traced",
    "TraceStats",
]
