/* addnorm.cuh: fused residual add + norm over the last dim (vLLM's fused_add_rms_norm).
 *
 * Contract (host encoding): in = (x, y, weight?, bias?) with x and y of one shape [..., N]
 * (any strides; x has no two elements at one address, since it is written), or y of shape
 * [S, ..., N] with 1 <= S <= GPUOS_MAX_PARTS: the S partial sums of a linear_parts (linear.cuh),
 * which stand for y = y[0] + y[1] + ... + y[S - 1], summed in that order in fp32 (parts.cuh);
 * weight and bias 1-D [N]; out has x's shape; scalars[0] = eps. Rows are numbered row-major over
 * all dims but the last (of x); a task covers rows [range_begin, range_end). Per row, in one task:
 *   r = x + y, computed in fp32 and rounded to x's dtype;  x = r  (x is updated in place);
 *   add_rmsnorm:   out = r * rsqrt(mean(r^2) + eps) * weight            (num_inputs 2..3)
 *   add_layernorm: out = (r - mean) * rsqrt(var + eps) * weight + bias  (num_inputs 2..4)
 * The norm reads the rounded r, exactly like torch's `r = (x + y).to(x.dtype); out = norm(r)`.
 * Fast path (contiguous tensors aligned to 4 elements, rows of at most 2048 a block or 256 a
 * warp, a multiple of 4): a thread loads its chunks of 4 of x, y and the parameters in one round
 * trip and keeps r in registers. Otherwise pass 1 loads x and y together, stores r into x and
 * sums it, and the remaining passes re-read r from x; each element is stored and re-read by the
 * same thread, so no barrier orders them.
 * Trace marks (bench/step_trace.py): 0 a row's sum, 1 its scale (the record's last row's); on the
 * fast path also 2 the parameters loaded, 3 the wait over, and 4-7 the end of thread 0's first,
 * second, third and last rows (a Llama-3.2-1B prefill record's four rows of 2,048: 4, 5, 6, 7). */
#pragma once

#include "ops/parts.cuh" /* found through -I<repo>/cuda */
#include "ops/rows.cuh"

/* 4-element chunks of a row a thread holds on the fast path with group G: 2, or 3 in a pair of
 * warps (a row of 768 on 64 threads). */
template <class G>
struct GpuosAddNormVec {
  static constexpr int value = 2;
};
template <>
struct GpuosAddNormVec<GpuosPairGroup> {
  static constexpr int value = 3;
};

/* Whether a row of n elements fits group G's fast path (its chunks of 4 a thread). */
template <class G>
__device__ __forceinline__ bool gpuos_addnorm_fits(int64_t n) {
  return n <= 4 * GpuosAddNormVec<G>::value * static_cast<int64_t>(G::size());
}

/* ---- the fast path: a row in registers ---------------------------------------------------- */

/* Whether the task's rows take the fast path with group G: every tensor contiguous and aligned
 * to 4 elements, rows a multiple of 4 long and at most GpuosAddNormVec chunks of 4 a thread.
 * Depends on the task only (uniform over the block). */
template <class G>
__device__ __forceinline__ bool gpuos_addnorm_fast(const GpuosTask* t, int64_t n) {
  bool ok = n % 4 == 0 && gpuos_addnorm_fits<G>(n);
  ok = ok && gpuos_is_contiguous(t->out) && gpuos_aligned4(t->out, 0);
  GPUOS_ROLLED
  for (int i = 0; i < t->num_inputs; ++i)
    ok = ok && gpuos_is_contiguous(t->in[i]) && gpuos_aligned4(t->in[i], 0);
  return ok;
}

/* Element offset in a row of a thread's chunk i (of 4 elements) on the fast path with group G. */
template <class G>
__device__ __forceinline__ int64_t gpuos_addnorm_chunk(int i) {
  return 4 * (G::rank() + i * static_cast<int64_t>(G::size()));
}

/* The parameters of a thread's chunks of a row on the fast path with group G, the same for
 * every row: the weight (1 without one) and the bias (0 without one). */
template <class G>
struct GpuosAddNormParams {
  float w[GpuosAddNormVec<G>::value][4], b[GpuosAddNormVec<G>::value][4];
};

/* All of a thread's loads are issued before any is unpacked, in one basic block: each chunk's
 * loads behind its own branch, unpacked before the next chunk's, were one round trip after
 * another (4 for a row of 768 on the block; GPT-2's 8-row step 1.3% longer, bench/NOTES.md).
 * Loads whose value is not used go to valid addresses: past the row, the tensor's chunk 0; for
 * a missing weight or bias, x's chunk. An rms norm loads no bias. */
template <bool RMS, class G>
__device__ __forceinline__ void gpuos_addnorm_params(const GpuosTask* t, int64_t n,
                                                     GpuosAddNormParams<G>& p) {
  constexpr int VEC = GpuosAddNormVec<G>::value;
  const bool has_w = t->num_inputs > 2, has_b = !RMS && t->num_inputs > 3;
  const GpuosTensorRef &w = t->in[has_w ? 2 : 0], &b = t->in[has_b ? 3 : 0];
  GpuosWord4 wq[VEC], bq[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int64_t j = gpuos_addnorm_chunk<G>(i) < n ? gpuos_addnorm_chunk<G>(i) : 0;
    wq[i] = gpuos_load_word4(gpuos_ptr(w, j), w.dtype);
    bq[i] = RMS ? GpuosWord4{} : gpuos_load_word4(gpuos_ptr(b, j), b.dtype);
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const bool in = gpuos_addnorm_chunk<G>(i) < n;
    float wv[4], bv[4];
    gpuos_unpack_word4(wq[i], w.dtype, wv);
    gpuos_unpack_word4(bq[i], b.dtype, bv);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p.w[i][e] = in && has_w ? wv[e] : 1.0f;
      p.b[i][e] = in && has_b ? bv[e] : 0.0f;
    }
  }
}

/* Row r (n elements) on the fast path, in one round trip: each thread loads its chunks of x and
 * y (all its parts) together, keeps the sums in registers and stores x and out once. PARTS: y's
 * parts, exactly (1: y is one tensor, or one part). */
template <bool RMS, int PARTS, class G>
__device__ __forceinline__ void gpuos_addnorm_fast_row(const GpuosTask* t, int64_t r, int64_t n,
                                                       const GpuosAddNormParams<G>& p) {
  constexpr int VEC = GpuosAddNormVec<G>::value;
  const GpuosTensorRef &x = t->in[0], &y = t->in[1];
  const int64_t split = PARTS > 1 ? gpuos_step(y, 0) : 0;
  const int64_t row = r * n;
  float v[VEC][4], sum[VEC][4];
#pragma unroll
  for (int i = 0; i < VEC; ++i) { /* every chunk's loads before any use */
    const int64_t j = gpuos_addnorm_chunk<G>(i);
    if (j >= n) continue;
    gpuos_load4(x, row + j, v[i]);
    gpuos_parts_load<PARTS>(gpuos_ptr(y, row + j), split, PARTS, y.dtype, sum[i]);
  }
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int64_t j = gpuos_addnorm_chunk<G>(i);
    if (j >= n) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[i][e] = gpuos_round_to(x.dtype, v[i][e] + sum[i][e]);
      s += RMS ? v[i][e] * v[i][e] : v[i][e];
    }
    gpuos_store4(x, row + j, v[i]);
  }
  const float total = G::sum(s);
  GPUOS_MARK(0);
  const float nf = static_cast<float>(n);
  float mean = 0.0f, scale;
  if (RMS) {
    scale = rsqrtf(gpuos_div(total, nf) + t->scalars[0]);
  } else {
    mean = gpuos_div(total, nf);
    float q = 0.0f; /* squared deviations from registers: E[x^2] - mean^2 cancels */
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (gpuos_addnorm_chunk<G>(i) >= n) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) q += (v[i][e] - mean) * (v[i][e] - mean);
    }
    scale = rsqrtf(gpuos_div(G::sum(q), nf) + t->scalars[0]);
  }
  GPUOS_MARK(1);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const int64_t j = gpuos_addnorm_chunk<G>(i);
    if (j >= n) continue;
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = (v[i][e] - mean) * scale * p.w[i][e] + p.b[i][e];
    gpuos_store4(t->out, row + j, o);
  }
}

/* The task's rows on the fast path with group G. Settled parameters (no producer writes them)
 * are loaded before the wait: they are cold when their layer comes, and loaded after it they
 * cost a trip to memory and a TLB walk on the critical path; else they are prefetched before
 * it and loaded after. */
template <bool RMS, int PARTS, class G>
__device__ __forceinline__ void gpuos_addnorm_fast_rows(const GpuosTask* t, int64_t n) {
  bool early = true;
  GPUOS_ROLLED
  for (int k = 2; k < t->num_inputs; ++k) early = early && gpuos_settled(t, k);
  GpuosAddNormParams<G> p;
  if (early) {
    gpuos_addnorm_params<RMS, G>(t, n, p);
    GPUOS_MARK(2);
    gpuos_await(t);
    GPUOS_MARK(3);
  } else {
    gpuos_norm_warm_await<2>(t);
    GPUOS_MARK(3);
    gpuos_addnorm_params<RMS, G>(t, n, p);
    GPUOS_MARK(2);
  }
  gpuos_each_row<G>(t, [&](int64_t r) {
    gpuos_addnorm_fast_row<RMS, PARTS, G>(t, r, n, p);
    /* thread 0's k-th row: its group's rows are G::count() apart (past the third: the last) */
    const int64_t k = (r - t->range_begin) / G::count();
    GPUOS_MARK(4 + static_cast<int>(k < 3 ? k : 3));
  });
}

/* The fast path's rows of y in `parts` parts: each count its own instantiation, which loads
 * exactly its parts. (Rounded up to 4 or 6, the missing parts' loads read part 0 again: as many
 * bytes from L2 as a part, since they bypass L1, and 3 of 4 of a GPT-2 prefill row's y.) */
template <bool RMS, class G, int PARTS = GPUOS_MAX_PARTS>
__device__ __forceinline__ void gpuos_addnorm_fast_parts(const GpuosTask* t, int64_t n, int parts) {
  if constexpr (PARTS > 1) {
    if (parts < PARTS) {
      gpuos_addnorm_fast_parts<RMS, G, PARTS - 1>(t, n, parts);
      return;
    }
  }
  gpuos_addnorm_fast_rows<RMS, PARTS, G>(t, n);
}

/* The fast path with group G when the task allows it; false otherwise, having done nothing. */
template <bool RMS, class G>
__device__ __forceinline__ bool gpuos_addnorm_try_fast(const GpuosTask* t, int64_t n) {
  if (!gpuos_addnorm_fast<G>(t, n)) return false;
  const GpuosTensorRef &x = t->in[0], &y = t->in[1];
  gpuos_addnorm_fast_parts<RMS, G>(t, n, y.ndim == x.ndim ? 1 : static_cast<int>(y.sizes[0]));
  return true;
}

/* ---- any layout: a row re-read from memory on each pass (rows.cuh) ------------------------ */

template <bool RMS>
struct GpuosAddNormRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    if (t->in[1].ndim == t->in[0].ndim + 1) {
      run_with<G>(t, r, GpuosParts<GPUOS_MAX_PARTS>::of(t->in[1]));
    } else {
      run_with<G>(t, r, gpuos_vector(t->in[1]));
    }
  }

  /* Y: y's row as a GpuosRow, or GpuosParts. */
  template <class G, class Y>
  __device__ static void run_with(const GpuosTask* t, int64_t r, Y y) {
    GpuosRow x = gpuos_vector(t->in[0]), out = gpuos_vector(t->out);
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

/* The fast path where the task allows it, else the passes of rows.cuh. Rows a warp each where
 * gpuos_rows_by_warp says so and a row fits a warp; else a pair of warps each where the record
 * has several rows and they fit (a prefill record's 4 rows of 768 side by side: a block took
 * them one after another, a round trip each), else the block each. A record of many long rows
 * (a 2,048-row prefill step's 16 rows of 768) once went to the warps' passes, which re-read
 * each row from memory: 40 us a record, against ~3 for 4 rows on the pairs' fast path. */
template <bool RMS>
__device__ __forceinline__ void gpuos_add_norm(const GpuosTask* t) {
  const int64_t n = gpuos_row_len(t->in[0]);
  const bool warps = gpuos_rows_by_warp(t, n) && gpuos_addnorm_fits<GpuosWarpGroup>(n);
  const bool pairs = t->range_end - t->range_begin > 1 && gpuos_addnorm_fits<GpuosPairGroup>(n);
  if (warps    ? gpuos_addnorm_try_fast<RMS, GpuosWarpGroup>(t, n)
      : pairs ? gpuos_addnorm_try_fast<RMS, GpuosPairGroup>(t, n)
              : gpuos_addnorm_try_fast<RMS, GpuosBlockGroup>(t, n))
    return;
  gpuos_norm_warm_await<2>(t);
  gpuos_rows<GpuosAddNormRow<RMS> >(t);
}

#define GPUOS_DEFINE_ADD_RMSNORM(SYMBOL) \
  GPUOS_OPERATOR(SYMBOL) { gpuos_add_norm<true>(t); }
#define GPUOS_DEFINE_ADD_LAYERNORM(SYMBOL) \
  GPUOS_OPERATOR(SYMBOL) { gpuos_add_norm<false>(t); }
