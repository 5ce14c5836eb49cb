"""The canary: before a new operator version is linked into a serving image, run it against its
reference on fresh random inputs in a child process with its own CUDA context. An operator that
faults or hangs kills or stalls only the child (DESIGN.md "Serving": a failed canary leaves the old
version serving); one that disagrees with its reference is rejected with the numbers.

The child is `python -m gpuos_core.canary`, fed one JSON payload on stdin, answering one JSON report
on stdout. It shares the parent's JIT cache, so the parent's own compile afterwards is a cache hit.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .calls import OpCall
from .catalogue import OpSpec
from .errors import CanaryCrashError, CanaryMismatchError
from .expr import evaluate

if TYPE_CHECKING:
    from .runtime import Runtime

# ‖out − ref‖ / ‖ref‖ a version may show against its reference, by output dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def payload(spec: OpSpec, seed: int) -> dict:
    """What the child needs to rebuild and exercise `spec` (a map operator)."""
    scalars = [p.default if p.default is not None else 0.5 * i - 0.5
               for i, p in enumerate(spec.scalars)]
    return {"name": spec.name, "expression": spec.source, "arity": spec.arity,
            "cuda": spec.cuda_body, "scalars": scalars, "seed": seed}


def run_sandboxed(spec: OpSpec, seed: int, timeout_s: float) -> list[dict]:
    """Run the canary of `spec` in a child process; its cases when they all pass. Raises
    CanaryCrashError when the child faults or outlives `timeout_s`, CanaryMismatchError when a
    case disagrees with the reference."""
    command = [sys.executable, "-m", "gpuos_core.canary"]
    try:
        done = subprocess.run(command, input=json.dumps(payload(spec, seed)), text=True,
                              capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CanaryCrashError(f"canary of {spec.name}: no answer within {timeout_s:.0f} s; the "
                               "operator hangs or is far too slow", _tail(exc.stderr)) from None
    if done.returncode != 0:
        raise CanaryCrashError(f"canary of {spec.name} failed (exit {done.returncode}): the "
                               "operator faults on the device", _tail(done.stderr))
    cases = json.loads(done.stdout.strip().splitlines()[-1])["cases"]
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise CanaryMismatchError(f"canary of {spec.name}: {len(bad)} of {len(cases)} case(s) "
                                  f"disagree with the reference: {_describe(bad)}", cases)
    return cases


def _tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _describe(cases: list[dict]) -> str:
    return "; ".join(f"{c['dtype']} {c['shape']}: relative error {c['rel_error']:.3g} > "
                     f"{c['tolerance']:.1g}" for c in cases[:4])


def input_shapes(arity: int) -> list[list[tuple[int, ...]]]:
    """Per case, the shape of each input: small, odd, 2-D and broadcast."""
    return [[(1,)] * arity, [(257,)] * arity, [(33, 65)] * arity,
            [(8, 1, 16)] + [(5, 16)] * (arity - 1)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error where both are finite; inf when their NaN/inf patterns differ."""
    out, ref = out.double(), ref.double()
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return float("inf")
    finite = torch.isfinite(ref) & torch.isfinite(out)
    if not torch.equal(out[~finite].nan_to_num(), ref[~finite].nan_to_num()):
        return float("inf")
    diff, norm = (out - ref)[finite].norm(), ref[finite].norm()
    return float(diff / norm) if norm > 0 else float(diff)


def exercise(runtime: "Runtime", name: str, spec: OpSpec, scalars: Sequence[float], seed: int
             ) -> list[dict]:
    """Run `name` on `runtime` over every case and compare with `spec`'s expression."""
    gen = torch.Generator().manual_seed(seed)
    named = {f"s{i}": v for i, v in enumerate(scalars[: spec.expression.num_scalars])}
    cases = []
    for shapes in input_shapes(spec.arity):
        for dtype_name, dtype in DTYPES.items():
            xs = tuple((torch.randn(s, generator=gen) * 2).to(dtype=dtype, device=runtime.device)
                       for s in shapes)
            out = runtime.submit([runtime.prepare(OpCall(name, xs, scalars=named))]).wait(30)
            ref = evaluate(spec.expression, xs, list(scalars)).to(dtype)
            err = rel_error(out.result(0), ref)
            cases.append({"shape": [list(s) for s in shapes], "dtype": dtype_name,
                          "rel_error": err, "tolerance": TOLERANCE[dtype],
                          "ok": err <= TOLERANCE[dtype]})
    return cases


def main() -> None:
    """Child side: rebuild the operator in a fresh CUDA runtime and report on it."""
    from .config import RuntimeConfig
    from .runtime import Runtime  # the child imports the runtime; the runtime imports this module

    job = json.loads(sys.stdin.read())
    config = RuntimeConfig(backend="cuda", canary=False, allow_raw_cuda=True)
    with Runtime(config=config) as runtime:
        name = f"canary_{job['name']}"[:48]
        made = runtime.register(name, job["expression"], job["arity"], cuda=job["cuda"])
        cases = exercise(runtime, name, made.spec, job["scalars"], job["seed"])
    print(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
