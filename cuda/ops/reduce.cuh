/* reduce.cuh: sum and mean of in[0] over the dims selected by reduce_mask.
 *
 * Contract (host encoding): out is encoded with in[0]'s ndim whatever keepdim (reduced dims have
 * size 1, stride 0); reduce_mask bit d = reduce over dim d of in[0]; work items are output
 * elements, row-major over out.sizes; a task covers items [range_begin, range_end). An empty
 * reduction gives 0 (sum) and NaN (mean), as torch does. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

/* Reductions at most this long are done by one thread each (many outputs, no barriers); longer
 * ones by the whole block per output. */
#define GPUOS_REDUCE_SERIAL_MAX 64

/* Partial sum, over k = first, first + step, ... < n, of element k of the reduced dims of x
 * (row-major over those dims), around element offset `base`. */
__device__ __forceinline__ float gpuos_reduce_partial(const GpuosTensorRef& x, unsigned int mask,
                                                      int64_t base, int64_t n, int64_t first,
                                                      int64_t step) {
  const auto at = [&](int64_t k) { return gpuos_ptr(x, base + gpuos_offset_dims(x, x, k, mask)); };
  float s = 0.0f;
  gpuos_each(first, n, step, x.dtype, at, [&](int64_t, float v) { s += v; });
  return s;
}

/* Element offset in x of the first reduced element of output o: walk out's shape (reduced dims
 * have size 1 there, so they take index 0) with x's strides. */
__device__ __forceinline__ int64_t gpuos_reduce_base(const GpuosTask* t, int64_t o) {
  return gpuos_offset_dims(t->out, t->in[0], o, GPUOS_ALL_DIMS);
}

template <bool MEAN>
__device__ __forceinline__ void gpuos_reduce_store(const GpuosTask* t, int64_t o, float s,
                                                   int64_t n) {
  gpuos_store(t->out, gpuos_offset(t->out, o), MEAN ? gpuos_div(s, static_cast<float>(n)) : s);
}

template <bool MEAN>
__device__ __forceinline__ void gpuos_reduce(const GpuosTask* t) {
  const GpuosTensorRef& x = t->in[0];
  const unsigned int mask = t->reduce_mask;
  const int64_t n = gpuos_numel_dims(x, mask);
  if (n <= GPUOS_REDUCE_SERIAL_MAX) {
    GPUOS_ROLLED
    for (int64_t o = t->range_begin + threadIdx.x; o < t->range_end; o += blockDim.x) {
      const int64_t base = gpuos_reduce_base(t, o);
      gpuos_reduce_store<MEAN>(t, o, gpuos_reduce_partial(x, mask, base, n, 0, 1), n);
    }
  } else {
    /* a row of logits: its elements k apart, read 4 at a load without index arithmetic */
    const bool packed = gpuos_dims_packed(x, mask);
    GpuosRow row = gpuos_vector(x);
    row.step = gpuos_dtype_size(x.dtype);
    GPUOS_ROLLED
    for (int64_t o = t->range_begin; o < t->range_end; ++o) {
      const int64_t base = gpuos_reduce_base(t, o);
      float s = 0.0f;
      if (packed) {
        row.p = gpuos_ptr(x, base);
        gpuos_row_each<GpuosBlockGroup, 2 * GPUOS_ILP>(row, n, [&](int64_t, float v) { s += v; });
      } else {
        s = gpuos_reduce_partial(x, mask, base, n, threadIdx.x, blockDim.x);
      }
      s = gpuos_block_sum(s);
      if (threadIdx.x == 0) gpuos_reduce_store<MEAN>(t, o, s, n);
    }
  }
}

#define GPUOS_DEFINE_SUM(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_reduce<false>(t); }
#define GPUOS_DEFINE_MEAN(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_reduce<true>(t); }
