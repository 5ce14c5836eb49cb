"""The canary: before a new operator version is linked into a serving image, run it against its
reference on fresh random inputs in a child process with its own CUDA context. An operator that
faults or hangs kills or stalls only the child (docs/DESIGN.md "Serving": a failed canary leaves
the old version serving); one that disagrees with its reference is rejected with the numbers.

The child is `python -m gpuos_core.canary_child`, fed one JSON payload on stdin, answering one JSON
report on stdout. It shares the parent's JIT cache, so the parent's own compile afterwards is a
cache hit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .calls import Params
from .catalogue import OpSpec
from .errors import CanaryCrashError, CanaryMismatchError, NonFiniteOutputError

# ‖out − ref‖ / ‖ref‖ a version may show against its reference, by output dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Where expressions break (overflow, poles, domains) and random inputs rarely go: every version
# beside the current one also runs on each combination of these.
EDGE_VALUES = (
    -1e4,
    -100.0,
    -10.0,
    -3.0,
    -1.0,
    -0.5,
    -1e-3,
    0.0,
    1e-3,
    0.5,
    1.0,
    3.0,
    10.0,
    100.0,
    1e4,
)


@dataclass(frozen=True)
class Comparison:
    """A candidate version beside the current one on the canary inputs (every dtype)."""

    max_abs_deviation: float  # largest |candidate - current| where both are finite
    nonfinite: int  # elements NaN or infinite in the candidate, finite in the current
    cases: list[dict] = field(repr=False)  # per input case and dtype: shape, dtype,
    # max_abs_deviation, nonfinite


def canary_scalars(spec: OpSpec) -> list[float]:
    """The scalar parameters canaries run `spec` with: defaults, else small distinct values."""
    return [
        p.default if p.default is not None else 0.5 * i - 0.5 for i, p in enumerate(spec.scalars)
    ]


def payload(spec: OpSpec, seed: int) -> dict:
    """What the child needs to rebuild and exercise `spec` (a map operator)."""
    return {
        "name": spec.name,
        "expression": spec.source,
        "arity": spec.arity,
        "cuda": spec.cuda_body,
        "scalars": canary_scalars(spec),
        "seed": seed,
    }


def compare_with_current(
    current: OpSpec, candidate: OpSpec, seed: int, allow_nonfinite: bool = False
) -> Comparison:
    """Run both versions' implementations (torch, on the CPU, whatever the backend: on a GPU the
    sandboxed canary checks the candidate's kernel against this same implementation) on the canary
    inputs and the edge values. Raises NonFiniteOutputError with the cases when the candidate is
    NaN or infinite where the current version is finite, unless `allow_nonfinite`."""
    params = Params(tuple(canary_scalars(current)))
    cases: list[dict[str, Any]] = []
    for xs in _comparison_inputs(current.arity, seed):
        for dtype_name, dtype in DTYPES.items():
            typed = [x.to(dtype) for x in xs]
            old = current.compute(typed, params).to(dtype)
            new = candidate.compute(typed, params).to(dtype)
            cases.append(
                {
                    "shape": [list(x.shape) for x in xs],
                    "dtype": dtype_name,
                    "max_abs_deviation": _max_abs(new, old),
                    "nonfinite": nonfinite_regressions(new, old),
                }
            )
    bad = [c for c in cases if c["nonfinite"]]
    if bad and not allow_nonfinite:
        raise NonFiniteOutputError(
            f"the new version of {current.name} is NaN or infinite where the current one is "
            f"finite in {len(bad)} of {len(cases)} case(s) (shapes and dtypes in `cases`); fix "
            "the expression, or send allow_nonfinite: true if that is intended",
            bad,
        )
    return Comparison(
        max(c["max_abs_deviation"] for c in cases), sum(c["nonfinite"] for c in cases), cases
    )


def nonfinite_regressions(new: torch.Tensor, old: torch.Tensor) -> int:
    """Elements where `new` is NaN or infinite and `old`, of the same shape, is finite."""
    return int((~torch.isfinite(new) & torch.isfinite(old)).sum())


def _max_abs(new: torch.Tensor, old: torch.Tensor) -> float:
    both = torch.isfinite(new) & torch.isfinite(old)
    return float((new.double() - old.double())[both].abs().max()) if both.any() else 0.0


def _comparison_inputs(arity: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """The canary's random cases (float32), then every combination of EDGE_VALUES."""
    gen = torch.Generator().manual_seed(seed)
    cases = [
        tuple(torch.randn(s, generator=gen) * 2 for s in shapes) for shapes in input_shapes(arity)
    ]
    edge = torch.tensor(EDGE_VALUES)
    grid = torch.meshgrid(*[edge] * arity, indexing="ij")
    return cases + [tuple(g.reshape(-1) for g in grid)]


def run_sandboxed(spec: OpSpec, seed: int, timeout_s: float) -> list[dict]:
    """Run the canary of `spec` in a child process; its cases when they all pass. Raises
    CanaryCrashError when the child faults or outlives `timeout_s`, CanaryMismatchError when a
    case disagrees with the reference."""
    command = [sys.executable, "-m", "gpuos_core.canary_child"]
    try:
        done = subprocess.run(
            command,
            input=json.dumps(payload(spec, seed)),
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise CanaryCrashError(
            f"canary of {spec.name}: no answer within {timeout_s:.0f} s; the "
            "operator hangs or is far too slow",
            _tail(exc.stderr),
        ) from None
    if done.returncode != 0:
        raise CanaryCrashError(
            f"canary of {spec.name} failed (exit {done.returncode}): the "
            "operator faults on the device",
            _tail(done.stderr),
        )
    cases = json.loads(done.stdout.strip().splitlines()[-1])["cases"]
    bad = [c for c in cases if not c["ok"]]
    if bad:
        raise CanaryMismatchError(
            f"canary of {spec.name}: {len(bad)} of {len(cases)} case(s) "
            f"disagree with the reference: {_describe(bad)}",
            cases,
        )
    return cases


def _tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _describe(cases: list[dict]) -> str:
    return "; ".join(
        f"{c['dtype']} {c['shape']}: relative error {c['rel_error']:.3g} > {c['tolerance']:.1g}"
        for c in cases[:4]
    )


def input_shapes(arity: int) -> list[list[tuple[int, ...]]]:
    """Per case, the shape of each input: small, odd, 2-D and broadcast."""
    return [
        [(1,)] * arity,
        [(257,)] * arity,
        [(33, 65)] * arity,
        [(8, 1, 16)] + [(5, 16)] * (arity - 1),
    ]


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
