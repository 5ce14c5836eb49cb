"""The canary's child process (`python -m gpuos_core.canary_child`, started by
canary.run_sandboxed): rebuild one operator version in a fresh CUDA runtime, run it over the
canary's cases against its expression, print one JSON report. Its own module so that the runtime,
which imports the canary, is not imported back by it."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import torch

from .calls import OpCall, Params
from .canary import DTYPES, TOLERANCE, input_shapes, rel_error
from .catalogue import OpSpec
from .config import CudaConfig, RuntimeConfig
from .runtime import Runtime


def exercise(
    runtime: Runtime, name: str, spec: OpSpec, scalars: Sequence[float], seed: int
) -> list[dict]:
    """Run `name` on `runtime` over every case and compare with `spec`'s torch implementation
    (its expression)."""
    gen = torch.Generator().manual_seed(seed)
    named = {param.name: v for param, v in zip(spec.scalars, scalars)}
    params = Params(tuple(scalars))
    cases = []
    for shapes in input_shapes(spec.arity):
        for dtype_name, dtype in DTYPES.items():
            xs = tuple(
                (torch.randn(s, generator=gen) * 2).to(dtype=dtype, device=runtime.device)
                for s in shapes
            )
            out = runtime.submit([runtime.prepare(OpCall(name, xs, scalars=named))]).wait(30)
            ref = spec.compute(xs, params).to(dtype)
            err = rel_error(out.result(0), ref)
            cases.append(
                {
                    "shape": [list(s) for s in shapes],
                    "dtype": dtype_name,
                    "rel_error": err,
                    "tolerance": TOLERANCE[dtype],
                    "ok": err <= TOLERANCE[dtype],
                }
            )
    return cases


def main() -> None:
    """Child side: rebuild the operator in a fresh CUDA runtime and report on it."""
    job = json.loads(sys.stdin.read())
    # a few small cases: a 32k-record ring, the default before LLM programs of several steps
    # (today's 128k would cost each swap 176 MB more of GPU and pinned memory)
    ring = CudaConfig(capacity=1 << 15)
    config = RuntimeConfig(backend="cuda", canary=False, allow_raw_cuda=True, cuda=ring)
    with Runtime(config=config) as runtime:
        name = f"canary_{job['name']}"[:48]
        made = runtime.register(name, job["expression"], job["arity"], cuda=job["cuda"])
        cases = exercise(runtime, name, made.spec, job["scalars"], job["seed"])
    print(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
