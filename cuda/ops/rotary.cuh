/* rotary.cuh: rotary position embedding, rotate-half (Llama / Hugging Face) form.
 *
 * Contract (host encoding): in = (x [..., D], cos, sin[, positions [...]]); out has x's shape; D is
 * even; rows are numbered row-major over out's leading dims; a task covers rows
 * [range_begin, range_end). Row r's cos/sin row c, s (length h = D/2) is:
 *   without positions: row r of cos/sin [..., h], expanded to out's leading dims;
 *   with positions (GPUOS_DTYPE_I32, expanded to out's leading dims): row positions[r] of the
 *   tables cos/sin [P, h], P >= 1, the position clamped into [0, P - 1] (read on the device, so a
 *   fixed task serves every step; the host validated the shapes, not the values).
 * For j < h:
 *   out[j]     = x[j]     * c[j] - x[j + h] * s[j]
 *   out[j + h] = x[j + h] * c[j] + x[j]     * s[j]
 * Each thread reads both halves of its pair before writing, so out may alias x.
 * rotary_parts (GPUOS_DEFINE_ROTARY_PARTS): x is [S, *out.shape], 1 <= S <= GPUOS_MAX_PARTS, the
 * partial sums of a linear_parts (parts.cuh), and stands for their sum in split order (fp32);
 * rows whose index along out's dim -2 is scalars[0] or more (an attention projection's v heads)
 * are that sum, not rotated (every row is rotated where out has no dim -2). */
#pragma once

#include "ops/parts.cuh" /* found through -I<repo>/cuda */

/* Pairs a thread takes of a row at a time where rows share a warp: their loads in flight
 * together. */
#define GPUOS_ROTARY_PAIRS 4
/* Rows a warp at least for them to share warps (gpuos_rotary_rows). */
#define GPUOS_ROTARY_PACKED 4

/* Input 0's row as gpuos_rotary_row reads it: x's own (P = 0), or the sum of its P parts
 * (rotary_parts: one instantiation a count, each loading exactly its parts). */
template <int P>
struct GpuosRotaryIn {
  using Row = GpuosParts<P>;
  __device__ static Row of(const GpuosTensorRef& x) { return Row::of(x); }
};
template <>
struct GpuosRotaryIn<0> {
  using Row = GpuosRow;
  __device__ static Row of(const GpuosTensorRef& x) { return gpuos_vector(x); }
};

/* Row r, its pairs j = first, first + step, ... < h (h = D / 2), U at a time; input 0 as
 * GpuosRotaryIn<P> reads it. */
template <int U, int P>
__device__ __forceinline__ void gpuos_rotary_row(const GpuosTask* t, int64_t r, int first,
                                                 int step) {
  typename GpuosRotaryIn<P>::Row x = GpuosRotaryIn<P>::of(t->in[0]);
  GpuosRow c = gpuos_vector(t->in[1]), s = gpuos_vector(t->in[2]), y = gpuos_vector(t->out);
  const int lead = gpuos_row_dims(t->out);
  if (t->num_inputs > 3) {
    GpuosRow pos = gpuos_vector(t->in[3]);
    gpuos_seek(t->out, lead, r, x, y, pos);
    const int64_t last = t->in[1].sizes[0] - 1, p = gpuos_load_i32(pos.p);
    const int64_t row = p < 0 ? 0 : (p < last ? p : last);
    c.advance(0, row);
    s.advance(0, row);
  } else {
    gpuos_seek(t->out, lead, r, x, c, s, y);
  }
  /* rotary_parts' rows past scalars[0] along dim -2 are only summed: their tables not loaded */
  const bool turn = P == 0 || lead < 1 ||
                    static_cast<float>(static_cast<unsigned int>(r) %
                                       static_cast<unsigned int>(t->out.sizes[lead - 1])) <
                        t->scalars[0];
  const int64_t h = gpuos_row_len(t->out) / 2;
  GPUOS_ROLLED
  for (int64_t j0 = first; j0 < h; j0 += U * step) {
    /* the pairs' loads all issued before any is used (past h: pair `first` again, not stored) */
    float x1[U], x2[U], cj[U], sj[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * step < h ? j0 + u * step : first;
      x1[u] = x.load(j), x2[u] = x.load(j + h);
      cj[u] = turn ? c.load(j) : 1.0f, sj[u] = turn ? s.load(j) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * step;
      if (j >= h) break;
      y.store(j, turn ? x1[u] * cj[u] - x2[u] * sj[u] : x1[u]);
      y.store(j + h, turn ? x2[u] * cj[u] + x1[u] * sj[u] : x2[u]);
    }
  }
}

/* gpuos_for_rows's form: a row by thread group G, a pair a thread at a time. */
template <int P>
struct GpuosRotaryRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    gpuos_rotary_row<1, P>(t, r, G::rank(), G::size());
  }
};

/* The task's rows, input 0 as GpuosRotaryIn<P> reads it. Where it has at least
 * GPUOS_ROTARY_PACKED rows a warp, each takes `lanes` threads side by side, the power of two
 * that gives each GPUOS_ROTARY_PAIRS pairs or fewer, at most a warp (rows of 32 pairs, D = 64: 8
 * lanes, 4 rows a warp at once). A row is a chain of round trips (its position, then its tables'
 * rows): one row a warp at a time, a Llama-1B 512-row prefill's q rotary took 18 us a record
 * (124 rows; H200, s254). Else, as the other row operators do, a warp a row (one pair a lane) or
 * the whole block a row for long rows (gpuos_rows_by_warp): with fewer rows the packed form's
 * batches cost more than they hide (s258-s259: +1.3 us a one-row decode step's 8-row record,
 * +0.5 us a 64-row step's 16-row one). Threads need no barrier: each reads both halves of its
 * pairs before writing them. */
template <int P>
__device__ __forceinline__ void gpuos_rotary_rows(const GpuosTask* t) {
  const int64_t h = gpuos_row_len(t->out) / 2, rows = t->range_end - t->range_begin;
  if (rows < GPUOS_ROTARY_PACKED * static_cast<int64_t>(GpuosWarpGroup::count())) {
    gpuos_for_rows<GpuosRotaryRow<P> >(t, h);
    return;
  }
  int lanes = 1;
  while (lanes < GPUOS_WARP && GPUOS_ROTARY_PAIRS * lanes < h) lanes *= 2;
  const int side = blockDim.x / lanes, lane = threadIdx.x % lanes;
  if (static_cast<int>(threadIdx.x) >= side * lanes) return; /* a block not a multiple of lanes */
  GPUOS_ROLLED
  for (int64_t r = t->range_begin + threadIdx.x / lanes; r < t->range_end; r += side)
    gpuos_rotary_row<GPUOS_ROTARY_PAIRS, P>(t, r, lane, lanes);
}

/* rotary_parts' rows in `parts` parts: each count its own instantiation. */
template <int P = GPUOS_MAX_PARTS>
__device__ __forceinline__ void gpuos_rotary_parts(const GpuosTask* t, int parts) {
  if constexpr (P > 1) {
    if (parts < P) {
      gpuos_rotary_parts<P - 1>(t, parts);
      return;
    }
  }
  gpuos_rotary_rows<P>(t);
}

#define GPUOS_DEFINE_ROTARY(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_rotary_rows<0>(t); }
#define GPUOS_DEFINE_ROTARY_PARTS(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_rotary_parts(t, static_cast<int>(t->in[0].sizes[0])); }
