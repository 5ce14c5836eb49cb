"""GPUOS: a persistent-kernel runtime for batched micro-operations (usable without Ray)."""
from .batch import Batch
from .calls import OpCall, Prepared
from .errors import (BackendUnavailableError, CompileError, ExpressionError, GpuosError, LinkError,
                     OperatorExistsError, RollbackError, RuntimeClosedError, TaskFailedError,
                     TensorSpecError, UnknownOperatorError, WaitTimeoutError)
from .config import CudaConfig, RuntimeConfig
from .runtime import Runtime

__all__ = [
    "Batch", "CudaConfig", "OpCall", "Prepared", "Runtime", "RuntimeConfig", "BackendUnavailableError",
    "CompileError", "ExpressionError", "GpuosError", "LinkError", "OperatorExistsError",
    "RollbackError", "RuntimeClosedError", "TaskFailedError", "TensorSpecError",
    "UnknownOperatorError", "WaitTimeoutError",
]
