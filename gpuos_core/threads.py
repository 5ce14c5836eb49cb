"""Daemon threads whose name the operating system sees too (Linux), so that `top -H`, `ps -L` and
/proc/<pid>/task/<tid>/comm tell the runtime's and the engine's threads from the rest of a replica
(loadtest/run.py reports CPU per request by these names)."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

OS_NAME_BYTES = 15  # Linux keeps this much of a thread's name (16 with the NUL)
_PR_SET_NAME = 15


def daemon(target: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread running `target`, named `name` in Python and (its first 15
    bytes) in the OS."""

    def run() -> None:
        name_os_thread(name)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (cut to 15 bytes) in the OS; nothing where the OS has no
    such call."""
    if not sys.platform.startswith("linux"):
        return
    # the process's own symbols hold libc's prctl: no library search (a subprocess, at times)
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:OS_NAME_BYTES], 0, 0, 0)
