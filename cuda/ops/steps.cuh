/* steps.cuh: decode steps chained on the device, so that the host can queue step k + 1 while
 * step k runs (serving/llm/device_step.py). Step k's program ends with `tick`; step k + 1's begins
 * with `feed_tokens`, which waits for that tick and takes the tokens step k sampled, which never
 * go through the host. Internal to the LLM engine: not served over HTTP.
 *
 * feed_tokens contract (host encoding: gpuos_core/families.py, FeedTokensFamily): in = (tokens [N],
 * sampled [P], clock [1], expect [1]), all GPUOS_DTYPE_I32 and contiguous; out [N] int32. One
 * record. Thread 0 first waits until clock[0] - expect[0] >= 0 (int32 serial arithmetic: the
 * clock may wrap), for at most GPUOS_FEED_WAIT_NS; then for each row r, with t = tokens[r]:
 *   t >= -1: out[r] = t (a token id, or -1 for an idle row);
 *   t <= -2: out[r] = sampled[-t - 2] (the token the previous step sampled for that logits row),
 *            or -1 when that row is not in sampled, or when the wait ran out (no step ticked:
 *            the previous one failed; the rows then embed zeros, and the engine fails them).
 *
 * tick contract: in = (after [...]) of any dtype, read by nobody (it orders the tick after the
 * task that writes it); out = clock [1] int32, updated in place: clock[0] += 1. Thread 0 adds
 * with release semantics after the worker's acquire of its producers' events, so a feed_tokens
 * that sees the new count sees everything the step wrote before (causality order is transitive).
 */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

/* How long feed_tokens waits for the previous step's tick (below the host's stall timeout). */
#define GPUOS_FEED_WAIT_NS 5000000000ull

__device__ __forceinline__ void gpuos_feed_tokens(const GpuosTask* t) {
  __shared__ int ticked;
  if (threadIdx.x == 0) {
    const int expect = gpuos_load_i32(gpuos_data(t->in[3]));
    const unsigned long long start = gpuos_now_ns();
    bool ok = false;
    const unsigned int* clock = reinterpret_cast<const unsigned int*>(gpuos_data(t->in[2]));
    while (!(ok = static_cast<int>(gpuos_acquire_u32(clock)) - expect >= 0) &&
           gpuos_now_ns() - start < GPUOS_FEED_WAIT_NS)
      __nanosleep(64);
    ticked = ok;
  }
  __syncthreads();
  const int* tokens = reinterpret_cast<const int*>(gpuos_data(t->in[0]));
  const int* sampled = reinterpret_cast<const int*>(gpuos_data(t->in[1]));
  int* out = reinterpret_cast<int*>(gpuos_data(t->out));
  const int64_t picks = t->in[1].numel;
  GPUOS_ROLLED
  for (int64_t r = t->range_begin + threadIdx.x; r < t->range_end; r += blockDim.x) {
    const int v = gpuos_load_i32(reinterpret_cast<const char*>(tokens + r));
    const int64_t pick = -2ll - v;
    const bool fed = v <= -2 && ticked && pick < picks;
    out[r] = v >= -1 ? v : (fed ? gpuos_load_i32(reinterpret_cast<const char*>(sampled + pick)) : -1);
  }
}

__device__ __forceinline__ void gpuos_tick(const GpuosTask* t) {
  if (threadIdx.x == 0)
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(t->out.data) : "memory");
}

#define GPUOS_DEFINE_FEED_TOKENS(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_feed_tokens(t); }

#define GPUOS_DEFINE_TICK(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_tick(t); }
