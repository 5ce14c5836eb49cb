/* map.cuh: elementwise operators, out = F(in[0], ..., in[ARITY-1]; scalars).
 *
 * Contract (host encoding): work items are output elements, row-major over out.sizes; a task covers
 * items [range_begin, range_end); every input ref is already expanded to out's ndim and sizes
 * (broadcast dims have stride 0), so the same linear index addresses all refs.
 *
 * The functor: struct F { __device__ float operator()(const float* a, const float* s) const; }
 * with a = the ARITY input values (fp32) and s = t->scalars. It must inline (keep it a small
 * inline member) so that `a` stays in registers. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

/* Element offset of item i in `ref`. CONTIGUOUS: every ref is row-major without broadcast, so the
 * offset is the linear index and no division is needed. */
template <bool CONTIGUOUS>
__device__ __forceinline__ int64_t gpuos_map_offset(const GpuosTensorRef& ref, int64_t i) {
  return CONTIGUOUS ? i : gpuos_offset(ref, i);
}

/* Items of the task in a block-stride loop, GPUOS_ILP per thread at a time: all their inputs are
 * loaded before any output is stored, so the loads are in flight together. Past the end, item i0
 * (always valid) is loaded again and not stored. */
template <int ARITY, class F, bool CONTIGUOUS>
__device__ __forceinline__ void gpuos_map_items(const GpuosTask* t) {
  const F f;
  GPUOS_ROLLED
  for (int64_t i0 = t->range_begin + threadIdx.x; i0 < t->range_end; i0 += GPUOS_ILP * blockDim.x) {
    float a[GPUOS_ILP][ARITY];
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t i = i0 + u * blockDim.x < t->range_end ? i0 + u * blockDim.x : i0;
#pragma unroll
      for (int k = 0; k < ARITY; ++k)
        a[u][k] = gpuos_load(t->in[k], gpuos_map_offset<CONTIGUOUS>(t->in[k], i));
    }
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t i = i0 + u * blockDim.x;
      if (i < t->range_end)
        gpuos_store(t->out, gpuos_map_offset<CONTIGUOUS>(t->out, i), f(a[u], t->scalars));
    }
  }
}

template <int ARITY, class F>
__device__ __forceinline__ void gpuos_map(const GpuosTask* t) {
  static_assert(ARITY >= 1 && ARITY <= GPUOS_MAX_INPUTS, "map arity must be 1..GPUOS_MAX_INPUTS");
  bool contiguous = gpuos_is_contiguous(t->out);
#pragma unroll
  for (int k = 0; k < ARITY; ++k) contiguous = contiguous && gpuos_is_contiguous(t->in[k]);
  if (contiguous) {
    gpuos_map_items<ARITY, F, true>(t);
  } else {
    gpuos_map_items<ARITY, F, false>(t);
  }
}

/* One map operator version: `extern "C" __device__ void SYMBOL(const GpuosTask*)`. */
#define GPUOS_DEFINE_MAP(SYMBOL, FUNCTOR, ARITY) \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) { gpuos_map<ARITY, FUNCTOR>(t); }
