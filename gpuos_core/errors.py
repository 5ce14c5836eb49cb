"""Typed errors of the runtime. Every message says what was wrong and what to do about it."""

from __future__ import annotations


class GpuosError(Exception):
    """Base class of every error the runtime raises on purpose."""


class ExpressionError(GpuosError, ValueError):
    """An operator expression could not be parsed or validated.

    `position` is the 0-based character offset of the offending token in `text`; `str()` shows the
    expression with a caret under that position.
    """

    def __init__(self, message: str, text: str, position: int) -> None:
        self.message, self.text, self.position = message, text, position
        super().__init__(f"{message} at position {position}\n  {text}\n  {' ' * position}^")


class CompileError(GpuosError):
    """NVRTC rejected a source; `log` holds the compiler's own log."""

    def __init__(self, message: str, log: str) -> None:
        self.log = log
        super().__init__(f"{message}\n{log}".rstrip())


class LinkError(GpuosError):
    """nvJitLink could not link an image; `log` holds the linker's error log."""

    def __init__(self, message: str, log: str) -> None:
        self.log = log
        super().__init__(f"{message}\n{log}".rstrip())


class UnknownOperatorError(GpuosError, KeyError):
    """No operator of that name is registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class OperatorExistsError(GpuosError, ValueError):
    """`register` was given a name that is taken: use `swap` to change an operator."""


class RollbackError(GpuosError, ValueError):
    """There is no previous version to roll back to."""


class TensorSpecError(GpuosError, ValueError):
    """A task's tensors do not fit its operator: wrong count, shape, dtype, device or size."""


class BackendUnavailableError(GpuosError, RuntimeError):
    """The requested backend cannot run on this machine."""


class TaskFailedError(GpuosError, RuntimeError):
    """A submitted task failed while executing; other tasks of its batch are unaffected."""


class WaitTimeoutError(GpuosError, TimeoutError):
    """A batch did not complete within the caller's timeout; the batch itself keeps running."""


class RuntimeClosedError(GpuosError, RuntimeError):
    """The runtime was closed; create a new one."""


class StalledWorkerError(GpuosError, RuntimeError):
    """Tasks were pending and the worker completed none of them within the stall deadline; the
    backend refuses further work (a Serve health check fails, so the replica is restarted)."""


class RawCudaDisabledError(GpuosError, PermissionError):
    """Raw CUDA operator source was given but this runtime's configuration does not allow it."""


class CanaryMismatchError(GpuosError, ValueError):
    """A new operator version ran but disagreed with its reference; `cases` holds the numbers."""

    def __init__(self, message: str, cases: list[dict]) -> None:
        self.cases = cases
        super().__init__(message)


class CanaryCrashError(GpuosError, RuntimeError):
    """A new operator version faulted or hung in the sandboxed canary; `log` holds its output."""

    def __init__(self, message: str, log: str) -> None:
        self.log = log
        super().__init__(f"{message}\n{log}".rstrip())


class ProgramError(GpuosError, ValueError):
    """A device program cannot be built as asked (an `after=` that names no earlier task)."""


class NonFiniteOutputError(GpuosError, ValueError):
    """A new operator version yields NaN or infinity where the version it would replace is finite;
    `cases` says where. The change is refused unless the caller allows non-finite outputs."""

    def __init__(self, message: str, cases: list[dict]) -> None:
        self.cases = cases
        super().__init__(message)
