"""First contact with a GPU: build the catalogue image, start the CUDA backend, run a few tasks and
print what happened. Quick to read when something hangs: faulthandler dumps every thread."""

from __future__ import annotations

import faulthandler
import sys
import time

import torch

faulthandler.dump_traceback_later(120, exit=True)
from gpuos_core import OpCall, Runtime  # noqa: E402

t0 = time.perf_counter()
rt = Runtime("cuda")
print(f"runtime up in {time.perf_counter() - t0:.2f} s: {rt.backend_reason}", flush=True)
x = torch.randn(4096, device="cuda")
y = torch.randn(4096, device="cuda")
out = rt.run("mul", x, y, timeout=10)
print("mul err", (out - x * y).abs().max().item(), flush=True)
s = rt.run("softmax", torch.randn(8, 1000, device="cuda"), timeout=10)
print("softmax row sums", s.sum(-1)[:3].tolist(), flush=True)
for n in (1, 1000, 10000):
    tasks = [rt.prepare(OpCall("add", (x, y))) for _ in range(n)]
    for _ in range(3):
        t0 = time.perf_counter()
        batch = rt.submit(tasks)
        t1 = time.perf_counter()
        batch.wait(10)
        t2 = time.perf_counter()
        print(
            f"{n} adds: submit {1e3 * (t1 - t0):.3f} ms, then complete {1e3 * (t2 - t1):.3f} ms; "
            f"launches {rt.backend.launches}",
            flush=True,
        )
    print("ok", all(torch.equal(r, x + y) for r in batch.results()[:50]), flush=True)
rt.close()
print("closed", flush=True)
sys.exit(0)
