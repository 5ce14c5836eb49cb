/* parts.cuh: a linear_parts' partial sums as the operators that consume them read them.
 *
 * linear_parts (linear.cuh) stores the sums of its S splits of K apart, [S, ..., N] fp32, and
 * nothing combines them: the consumer reads an element as y[0] + y[1] + ... + y[S - 1], summed
 * in that order in fp32, in the same round trip as its other loads (the fused residual norms,
 * addnorm.cuh; rotary_parts, rotary.cuh). families.py's LINEAR_MAX_PARTS is GPUOS_MAX_PARTS. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

#define GPUOS_MAX_PARTS 6

/* W (1 or 4) contiguous elements at byte address `p`, the sum of their `count` <= MAXP parts
 * `split` bytes apart in split order. Branch-free, so that all the loads are in flight together:
 * past the parts, part 0 is loaded again and not added (a branch a part had ptxas reuse one
 * register for every part, a round trip each). Callers that know the count pass it as MAXP too
 * (one instantiation a count), so that only their generic paths load a part twice. */
template <int MAXP, int W>
__device__ __forceinline__ void gpuos_parts_load(const char* p, int64_t split, int count,
                                                 int dtype, float (&v)[W]) {
  static_assert(W == 1 || W == 4, "one element, or one vector load of 4");
  float part[MAXP][W];
#pragma unroll
  for (int s = 0; s < MAXP; ++s) {
    const char* at = p + (s < count ? s * split : 0);
    if constexpr (W == 4) {
      gpuos_load4_ptr(at, dtype, part[s]);
    } else {
      part[s][0] = gpuos_load_ptr(at, dtype);
    }
  }
#pragma unroll
  for (int e = 0; e < W; ++e) {
    v[e] = part[0][e];
#pragma unroll
    for (int s = 1; s < MAXP; ++s) {
      if (s < count) v[e] += part[s][e];
    }
  }
}

/* One row of parts [S, ..., N] (S <= MAXP), read like a GpuosRow: load(j) is element j's sum in
 * split order (gpuos_parts_load); advance moves along the dims after the first, so gpuos_seek
 * takes it to a row numbered over the leading dims of the sum. */
template <int MAXP>
struct GpuosParts {
  char* p;       /* split 0's element 0 of the row */
  int64_t step;  /* bytes between elements */
  int64_t split; /* bytes between splits */
  int count, dtype;
  const GpuosTensorRef* ref;

  __device__ static GpuosParts of(const GpuosTensorRef& y) {
    GpuosParts parts;
    parts.p = gpuos_data(y);
    parts.step = gpuos_step(y, y.ndim - 1);
    parts.split = gpuos_step(y, 0);
    parts.count = static_cast<int>(y.sizes[0]);
    parts.dtype = y.dtype;
    parts.ref = &y;
    return parts;
  }
  __device__ __forceinline__ float load(int64_t j) const {
    float sum[1];
    gpuos_parts_load<MAXP>(p + j * step, split, count, dtype, sum);
    return sum[0];
  }
  __device__ __forceinline__ void advance(int d, int64_t i) { p += i * gpuos_step(*ref, d + 1); }
};
