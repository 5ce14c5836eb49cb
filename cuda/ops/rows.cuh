/* rows.cuh: operators over the last dim of in[0], one row at a time.
 *
 * Contract (host encoding): rows are numbered row-major over all dims but the last of in[0] (and
 * of out, which has in[0]'s shape); a task covers rows [range_begin, range_end).
 *   softmax, log_softmax: in = (x); numerically stable (max subtracted).
 *   layernorm: in = (x, weight?, bias?), num_inputs 1..3, weight/bias 1-D over the last dim;
 *              scalars[0] = eps; biased variance; y = (x - mean) * rsqrt(var + eps) * w + b.
 *   rmsnorm:   in = (x, weight?), scalars[0] = eps; y = x * rsqrt(mean(x^2) + eps) * w.
 * Each row op is a struct with `template <class G> static void run(const GpuosTask*, int64_t r)`,
 * G a thread group from gpuos_device.cuh; rows are re-read from memory on each pass (L1/L2 hits)
 * rather than held in a register array, GPUOS_ILP elements in flight per thread. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

template <bool LOG>
struct GpuosSoftmaxRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), y = gpuos_vector(t->out);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, y);
    const int64_t n = gpuos_row_len(t->in[0]);
    float m = gpuos_neg_inf();
    gpuos_row_each<G>(x, n, [&](int64_t, float v) { m = fmaxf(m, v); });
    m = G::max(m);
    float s = 0.0f;
    gpuos_row_each<G>(x, n, [&](int64_t, float v) { s += expf(v - m); });
    s = G::sum(s);
    if (LOG) {
      const float log_s = logf(s);
      gpuos_row_each<G>(x, n, [&](int64_t j, float v) { y.store(j, (v - m) - log_s); });
    } else {
      const float inv = gpuos_div(1.0f, s);
      gpuos_row_each<G>(x, n, [&](int64_t j, float v) { y.store(j, expf(v - m) * inv); });
    }
  }
};

/* The passes of a layernorm row after the first: x's row (already positioned) and its sum `sum`
 * are known; y = (x - mean) * rsqrt(var + eps) * w + b with the optional weight and bias in
 * in[W] and in[W + 1]. Shared with the fused residual norms (addnorm.cuh), whose weights come
 * after their residual input. */
template <int W, class G>
__device__ __forceinline__ void gpuos_layernorm_tail(const GpuosTask* t, const GpuosRow& x,
                                                     const GpuosRow& y, int64_t n, float sum) {
  const float mean = gpuos_div(sum, static_cast<float>(n));
  /* Sum squared deviations (two passes): E[x^2] - mean^2 cancels catastrophically. */
  float q = 0.0f;
  gpuos_row_each<G>(x, n, [&](int64_t, float v) { q += (v - mean) * (v - mean); });
  const float rstd = rsqrtf(gpuos_div(G::sum(q), static_cast<float>(n)) + t->scalars[0]);
  GPUOS_MARK(1);
  const bool has_w = t->num_inputs > W, has_b = t->num_inputs > W + 1;
  const GpuosRow w = gpuos_vector(t->in[W]), b = gpuos_vector(t->in[W + 1]);
  gpuos_row_each<G>(x, n, [&](int64_t j, float v) {
    const float o = (v - mean) * rstd;
    const float ow = has_w ? o * w.load(j) : o;
    y.store(j, has_b ? ow + b.load(j) : ow);
  });
}

/* The last pass of an rmsnorm row whose sum of squares `sumsq` is known; the optional weight is
 * in[W]. */
template <int W, class G>
__device__ __forceinline__ void gpuos_rmsnorm_tail(const GpuosTask* t, const GpuosRow& x,
                                                   const GpuosRow& y, int64_t n, float sumsq) {
  const float rms = rsqrtf(gpuos_div(sumsq, static_cast<float>(n)) + t->scalars[0]);
  const bool has_w = t->num_inputs > W;
  const GpuosRow w = gpuos_vector(t->in[W]);
  gpuos_row_each<G>(
      x, n, [&](int64_t j, float v) { y.store(j, has_w ? v * rms * w.load(j) : v * rms); });
}

struct GpuosLayerNormRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), y = gpuos_vector(t->out);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, y);
    const int64_t n = gpuos_row_len(t->in[0]);
    float s = 0.0f;
    gpuos_row_each<G>(x, n, [&](int64_t, float v) { s += v; });
    gpuos_layernorm_tail<1, G>(t, x, y, n, G::sum(s));
  }
};

struct GpuosRmsNormRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), y = gpuos_vector(t->out);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, y);
    const int64_t n = gpuos_row_len(t->in[0]);
    float q = 0.0f;
    gpuos_row_each<G>(x, n, [&](int64_t, float v) { q += v * v; });
    gpuos_rmsnorm_tail<1, G>(t, x, y, n, G::sum(q));
  }
};

/* The norms' records are GPUOS_TASK_EARLY (families.py): before waiting for x, ask L2 for their
 * parameters in[W..] (weight, bias), one 128-byte line per thread at a time. Weights are read once
 * a step and evicted by the next layers' in between: loaded after the wait they cost a trip to
 * memory (and a TLB walk) on the critical path. A prefetch is only a hint, so a parameter that a
 * producer does write is still read right after the wait. */
template <int W>
__device__ __forceinline__ void gpuos_norm_warm_await(const GpuosTask* t) {
  GPUOS_ROLLED
  for (int i = W; i < t->num_inputs; ++i) {
    const GpuosTensorRef& w = t->in[i];
    const char* p = gpuos_data(w);
    const int64_t bytes = w.ndim == 1 && w.strides[0] == 1 ? w.numel * gpuos_dtype_size(w.dtype) : 0;
    GPUOS_ROLLED
    for (int64_t at = 128 * static_cast<int64_t>(threadIdx.x); at < bytes; at += 128 * blockDim.x)
      gpuos_prefetch_line(p + at);
  }
  gpuos_await(t);
}

template <class Op>
__device__ __forceinline__ void gpuos_rows(const GpuosTask* t) {
  gpuos_for_rows<Op>(t, gpuos_row_len(t->in[0]));
}

#define GPUOS_DEFINE_SOFTMAX(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_rows<GpuosSoftmaxRow<false> >(t); }
#define GPUOS_DEFINE_LOG_SOFTMAX(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_rows<GpuosSoftmaxRow<true> >(t); }
#define GPUOS_DEFINE_LAYERNORM(SYMBOL) \
  GPUOS_OPERATOR(SYMBOL) {             \
    gpuos_norm_warm_await<1>(t);       \
    gpuos_rows<GpuosLayerNormRow>(t);  \
  }
#define GPUOS_DEFINE_RMSNORM(SYMBOL) \
  GPUOS_OPERATOR(SYMBOL) {           \
    gpuos_norm_warm_await<1>(t);     \
    gpuos_rows<GpuosRmsNormRow>(t);  \
  }
