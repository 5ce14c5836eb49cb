#!/usr/bin/env bash
# One call on a CUDA machine: GPU tests, then the benchmarks; JSON and logs go to $OUT (or
# bench/results/ when $OUT is unset). Runs with the machine's python3 and whatever it has; every
# step has a timeout because a wedged worker can hang a process (docs/DESIGN.md, protocol 5).
#   bash bench/gpu_check.sh [quick|bench]   quick: smoke + GPU tests only; bench: benchmarks only
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export GPUOS_CACHE_DIR="${GPUOS_CACHE_DIR:-/tmp/gpuos-cache}"
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember failures
    local name=$1 limit=$2; shift 2
    echo "== $name"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    ((rc == 0)) || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step build 300 python3 -m gpuos_core.build
mode="${1:-all}"
if [[ "$mode" != bench ]]; then
    step smoke 120 python3 bench/gpu_smoke.py
    step gpu-tests 560 python3 -m pytest -m gpu -q -x -p no:cacheprovider -o faulthandler_timeout=100 tests/gpu tests/unit/test_catalogue.py tests/unit/test_runtime.py tests/unit/test_program.py tests/unit/test_index_ops.py tests/unit/test_attention.py tests/unit/test_fused_norm.py tests/unit/test_device_sampling.py tests/unit/test_linear.py tests/unit/test_gather_rows.py tests/unit/test_scheduler.py tests/unit/test_llm_engine.py
fi
if [[ "$mode" != quick ]]; then
    step micro 420 python3 bench/micro.py --out "$OUT"
    step sched 300 python3 bench/sched.py --out "$OUT"
    step llm 600 python3 bench/llm.py --decode-steps 1 4 --out "$OUT"
    step host-phases 300 python3 bench/host_phases.py --out "$OUT"
    step kernels 420 python3 bench/kernels.py --out "$OUT"
fi
# The serving load test needs Ray Serve, FastAPI and Locust, which the GPU host lacks: carry the
# bundle that ../shared/tools/offline_site.sh builds (.devbundle/site.tar.xz) to run it; build it as
# `offline_site.sh orjson`: serving's JSON answers use orjson, which the script leaves out by itself.
if [[ -f .devbundle/site.tar.xz && "$mode" != quick ]]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .devbundle/site.tar.xz
    export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
    step loadtest 300 python3 -m loadtest.run micro --users 64 --duration 30 --out "$OUT/loadtest"
    step loadtest-completions 300 python3 -m loadtest.run completions --users 32 --duration 30 \
        --coalescing on --out "$OUT/loadtest"
fi
exit $status
