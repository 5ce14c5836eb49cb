"""Configuration of the Serve layer: the app's `args:` and the coalescer's `user_config:`.

Both are pydantic models that reject unknown keys, so a typo in a Serve config fails the deploy with
the key's name instead of being ignored. Neither imports Ray: the coalescer is tested without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["auto", "cuda", "cpu"]
ADMIN_TOKEN_ENV = "GPUOS_ADMIN_TOKEN"
STATE_DIR_ENV = "GPUOS_STATE_DIR"
DEFAULT_STATE_DIR = Path("~/.local/state/gpuos")


class LlmArgs(BaseModel):
    """The `llm:` block of the app's args: the model behind /v1/completions and its engine."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # False: no model, /v1/completions answers 404
    model: str | None = None  # Hugging Face directory; None: a seeded tiny model
    tiny_family: Literal["gpt2", "llama"] = "gpt2"  # which tiny model when `model` is None
    served_name: str | None = None  # id clients send as `model`; None: the directory's name
    dtype: Literal["float32", "float16", "bfloat16"] | None = None  # None: the checkpoint's
    max_running: int = Field(64, ge=1, le=1024)  # requests decoded together (KV slots)
    max_len: int | None = Field(None, ge=2)  # tokens per slot; None: the model's limit
    max_waiting: int = Field(256, ge=0)  # queued beyond this: 503
    max_step_tokens: int = Field(2048, ge=1)  # new rows one step takes (prompts chunked)
    decode_steps: int = Field(1, ge=1, le=16)  # decode steps one program runs back to back
    micro_ops: Literal["runtime", "torch"] = "runtime"  # torch: the per-op baseline


class AppArgs(BaseModel):
    """The `args:` block of a Serve config. Unknown keys are rejected so that a typo cannot pass
    silently."""

    model_config = ConfigDict(extra="forbid")

    backend: Backend = "auto"  # runtime backend of every replica; auto = cuda when a GPU is visible
    admin_token: str | None = None  # bearer token of /admin; None: $GPUOS_ADMIN_TOKEN; unset: off
    state_dir: str | None = None  # registry; None: $GPUOS_STATE_DIR or ~/.local/state/gpuos
    max_elements: int = Field(1 << 20, ge=1)  # most tensor elements one /v1/ops request may carry
    allow_raw_cuda: bool = False  # let /admin register and swap operators written as raw CUDA
    num_cpus: float = Field(1.0, ge=0)  # CPUs one replica reserves in Ray's scheduler
    watch_s: float = Field(600.0, ge=0)  # after a swap, failures this long roll it back (0: off)
    # The interpreter's switch interval in a replica: how long a thread busy in Python (the event
    # loop serving requests) keeps the GIL from one that wants it back after a system call or a
    # torch call (the LLM engine's step, the runtime's poller). Python's default is 5 ms.
    switch_interval_ms: float = Field(1.0, gt=0, le=100)
    llm: LlmArgs = LlmArgs()  # the model behind /v1/completions

    def resolved_admin_token(self) -> str | None:
        """The admin token in force: the arg, else the environment; None disables /admin."""
        return self.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None

    def resolved_state_dir(self) -> Path:
        """The registry's directory: the arg, else the environment, else the XDG default."""
        raw = self.state_dir or os.environ.get(STATE_DIR_ENV) or str(DEFAULT_STATE_DIR)
        return Path(raw).expanduser()

    def max_body_bytes(self) -> int:
        """Largest request body read before parsing: generous for `max_elements` JSON numbers
        (a float32 printed in full is at most ~16 characters), so only abuse is cut off early."""
        return 32 * self.max_elements + (1 << 20)


# The coalescer's knobs' ranges, shared by its config and the admin API's partial update.
MaxBatch = Annotated[int, Field(ge=1, le=4096)]
WindowUs = Annotated[int, Field(ge=0, le=1_000_000)]
MaxQueue = Annotated[int, Field(ge=1, le=1 << 20)]
DeadlineMs = Annotated[int, Field(ge=1, le=3_600_000)]


class CoalescerConfig(BaseModel):
    """The coalescer's knobs: the deployment's `user_config`, changed live by `reconfigure`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # False: one runtime submission per request (the comparison baseline)
    max_batch: MaxBatch = 64  # flush as soon as this many tasks wait
    window_us: WindowUs = 200  # ... or this long after the first of them
    max_queue: MaxQueue = 1024  # waiting tasks beyond this are refused (503)
    deadline_ms: DeadlineMs = 10_000  # a request not answered by then fails (504)
