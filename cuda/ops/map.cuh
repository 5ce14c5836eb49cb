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

/* Items [begin, range_end) of the task in a block-stride loop, GPUOS_ILP per thread at a time: all their inputs are
 * loaded before any output is stored, so the loads are in flight together. Past the end, item i0
 * (always valid) is loaded again and not stored. */
template <int ARITY, class F, bool CONTIGUOUS>
__device__ __forceinline__ void gpuos_map_items(const GpuosTask* t, int64_t begin) {
  const F f;
  GPUOS_ROLLED
  for (int64_t i0 = begin + threadIdx.x; i0 < t->range_end; i0 += GPUOS_ILP * blockDim.x) {
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

/* Whether items 4c .. 4c + 3 of `ref` are 4 neighbours that one vector access moves, for every
 * c: unit stride along a last dim of a multiple of 4 elements, every other stride a multiple of 4
 * (broadcast: 0), the data aligned to 4 elements. Rows of a view (swiglu's halves of one
 * projection) qualify where the whole tensor is not contiguous. */
__device__ __forceinline__ bool gpuos_map_quads(const GpuosTensorRef& ref) {
  const int last = ref.ndim - 1;
  bool ok = ref.ndim > 0 && ref.strides[last] == 1 && ref.sizes[last] % 4 == 0;
  GPUOS_ROLLED
  for (int d = 0; d < last; ++d) ok = ok && ref.strides[d] % 4 == 0;
  return ok && gpuos_aligned4(ref, 0);
}

/* Groups of four items per thread, each input and the output moved with one vector access, the
 * groups from range_begin on (CONTIGUOUS: every ref row-major and aligned at range_begin, so an
 * item's offset is its index; else every ref passes gpuos_map_quads and range_begin is a
 * multiple of 4, and a group's offset is computed once for its four items). Returns the first
 * item it left (the last count % 4 items) for the scalar loop. */
template <int ARITY, class F, bool CONTIGUOUS>
__device__ __forceinline__ int64_t gpuos_map_vec4(const GpuosTask* t) {
  const F f;
  const int64_t end = t->range_begin + ((t->range_end - t->range_begin) & ~int64_t(3));
  GPUOS_ROLLED
  for (int64_t i = t->range_begin + 4 * threadIdx.x; i < end; i += 4 * blockDim.x) {
    float a[ARITY][4], r[4];
#pragma unroll
    for (int k = 0; k < ARITY; ++k)
      gpuos_load4(t->in[k], gpuos_map_offset<CONTIGUOUS>(t->in[k], i), a[k]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float x[ARITY];
#pragma unroll
      for (int k = 0; k < ARITY; ++k) x[k] = a[k][j];
      r[j] = f(x, t->scalars);
    }
    gpuos_store4(t->out, gpuos_map_offset<CONTIGUOUS>(t->out, i), r);
  }
  return end;
}

template <int ARITY, class F>
__device__ __forceinline__ void gpuos_map(const GpuosTask* t) {
  static_assert(ARITY >= 1 && ARITY <= GPUOS_MAX_INPUTS, "map arity must be 1..GPUOS_MAX_INPUTS");
  bool contiguous = gpuos_is_contiguous(t->out);
  bool aligned = gpuos_aligned4(t->out, t->range_begin);
  bool quads = gpuos_map_quads(t->out) && t->range_begin % 4 == 0;
#pragma unroll
  for (int k = 0; k < ARITY; ++k) {
    contiguous = contiguous && gpuos_is_contiguous(t->in[k]);
    aligned = aligned && gpuos_aligned4(t->in[k], t->range_begin);
    quads = quads && gpuos_map_quads(t->in[k]);
  }
  if (contiguous && aligned) {
    gpuos_map_items<ARITY, F, true>(t, gpuos_map_vec4<ARITY, F, true>(t));
  } else if (contiguous) {
    gpuos_map_items<ARITY, F, true>(t, t->range_begin);
  } else if (quads) {
    gpuos_map_items<ARITY, F, false>(t, gpuos_map_vec4<ARITY, F, false>(t));
  } else {
    gpuos_map_items<ARITY, F, false>(t, t->range_begin);
  }
}

/* One map operator version, SYMBOL (GPUOS_OPERATOR). */
#define GPUOS_DEFINE_MAP(SYMBOL, FUNCTOR, ARITY) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_map<ARITY, FUNCTOR>(t); }
