/* addnorm.cuh: fused residual add + norm over the last dim (vLLM's fused_add_rms_norm).
 *
 * Contract (host encoding): in = (x, y, weight?, bias?) with x and y of one shape [..., N]
 * (any strides; x has no two elements at one address, since it is written); weight and bias 1-D
 * [N]; out has x's shape; scalars[0] = eps. Rows are numbered row-major over all dims but the
 * last; a task covers rows [range_begin, range_end). Per row, in one task:
 *   r = x + y, computed in fp32 and rounded to x's dtype;  x = r  (x is updated in place);
 *   add_rmsnorm:   out = r * rsqrt(mean(r^2) + eps) * weight            (num_inputs 2..3)
 *   add_layernorm: out = (r - mean) * rsqrt(var + eps) * weight + bias  (num_inputs 2..4)
 * The norm reads the rounded r, exactly like torch's `r = (x + y).to(x.dtype); out = norm(r)`.
 * Pass 1 loads x and y together, stores r into x and sums it; the remaining passes re-read r
 * from x. Each element is stored and re-read by the same thread, so no barrier orders them. */
#pragma once

#include "ops/rows.cuh" /* found through -I<repo>/cuda */

template <bool RMS>
struct GpuosAddNormRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), y = gpuos_vector(t->in[1]), out = gpuos_vector(t->out);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, y, out);
    const int64_t n = gpuos_row_len(t->in[0]);
    float s = 0.0f;
    gpuos_row_each2<G>(x, y, n, [&](int64_t j, float a, float b) {
      const float sum = gpuos_round_to(x.dtype, a + b);
      x.store(j, sum);
      s += RMS ? sum * sum : sum;
    });
    GPUOS_MARK(0);
    if (RMS) {
      gpuos_rmsnorm_tail<2, G>(t, x, out, n, G::sum(s));
    } else {
      gpuos_layernorm_tail<2, G>(t, x, out, n, G::sum(s));
    }
  }
};

#define GPUOS_DEFINE_ADD_RMSNORM(SYMBOL)                  \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) { \
    gpuos_norm_warm_await<2>(t);                          \
    gpuos_rows<GpuosAddNormRow<true> >(t);                \
  }
#define GPUOS_DEFINE_ADD_LAYERNORM(SYMBOL)                \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) { \
    gpuos_norm_warm_await<2>(t);                          \
    gpuos_rows<GpuosAddNormRow<false> >(t);               \
  }
