/* rotary.cuh: rotary position embedding, rotate-half (Llama / Hugging Face) form.
 *
 * Contract (host encoding): in = (x [..., D], cos, sin[, positions [...]]); out has x's shape; D is
 * even; rows are numbered row-major over x's leading dims; a task covers rows
 * [range_begin, range_end). Row r's cos/sin row c, s (length h = D/2) is:
 *   without positions: row r of cos/sin [..., h], expanded to x's leading dims;
 *   with positions (GPUOS_DTYPE_I32, expanded to x's leading dims): row positions[r] of the tables
 *   cos/sin [P, h], P >= 1, the position clamped into [0, P - 1] (read on the device, so a fixed
 *   task serves every step; the host validated the shapes, not the values).
 * For j < h:
 *   out[j]     = x[j]     * c[j] - x[j + h] * s[j]
 *   out[j + h] = x[j + h] * c[j] + x[j]     * s[j]
 * Each thread reads both halves of its pair before writing, so out may alias x. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

/* Pairs a thread takes of a row at a time where rows share a warp: their loads in flight
 * together. */
#define GPUOS_ROTARY_PAIRS 4
/* Rows a warp at least for them to share warps (gpuos_rotary). */
#define GPUOS_ROTARY_PACKED 4

/* Row r, its pairs j = first, first + step, ... < h (h = D / 2), U at a time. */
template <int U>
__device__ __forceinline__ void gpuos_rotary_row(const GpuosTask* t, int64_t r, int first,
                                                 int step) {
  GpuosRow x = gpuos_vector(t->in[0]), c = gpuos_vector(t->in[1]), s = gpuos_vector(t->in[2]);
  GpuosRow y = gpuos_vector(t->out);
  const int lead = gpuos_row_dims(t->in[0]);
  if (t->num_inputs > 3) {
    GpuosRow pos = gpuos_vector(t->in[3]);
    gpuos_seek(t->in[0], lead, r, x, y, pos);
    const int64_t last = t->in[1].sizes[0] - 1, p = gpuos_load_i32(pos.p);
    const int64_t row = p < 0 ? 0 : (p < last ? p : last);
    c.advance(0, row);
    s.advance(0, row);
  } else {
    gpuos_seek(t->in[0], lead, r, x, c, s, y);
  }
  const int64_t h = gpuos_row_len(t->in[0]) / 2;
  GPUOS_ROLLED
  for (int64_t j0 = first; j0 < h; j0 += U * step) {
    /* the pairs' loads all issued before any is used (past h: pair `first` again, not stored) */
    float x1[U], x2[U], cj[U], sj[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * step < h ? j0 + u * step : first;
      x1[u] = x.load(j), x2[u] = x.load(j + h), cj[u] = c.load(j), sj[u] = s.load(j);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + u * step;
      if (j >= h) break;
      y.store(j, x1[u] * cj[u] - x2[u] * sj[u]);
      y.store(j + h, x2[u] * cj[u] + x1[u] * sj[u]);
    }
  }
}

/* gpuos_for_rows's form: a row by thread group G, a pair a thread at a time. */
struct GpuosRotaryRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    gpuos_rotary_row<1>(t, r, G::rank(), G::size());
  }
};

/* The task's rows. Where it has at least GPUOS_ROTARY_PACKED rows a warp, each takes `lanes`
 * threads side by side, the power of two that gives each GPUOS_ROTARY_PAIRS pairs or fewer, at
 * most a warp (rows of 32 pairs, D = 64: 8 lanes, 4 rows a warp at once). A row is a chain of
 * round trips (its position, then its tables' rows): one row a warp at a time, a Llama-1B
 * 512-row prefill's q rotary took 18 us a record (124 rows; H200, s254). Else, as the other row
 * operators do, a warp a row (one pair a lane) or the whole block a row for long rows
 * (gpuos_rows_by_warp): with fewer rows the packed form's batches cost more than they hide
 * (s258-s259: +1.3 us a one-row decode step's 8-row record, +0.5 us a 64-row step's 16-row
 * one). Threads need no barrier: each reads both halves of its pairs before writing them. */
__device__ __forceinline__ void gpuos_rotary(const GpuosTask* t) {
  const int64_t h = gpuos_row_len(t->in[0]) / 2, rows = t->range_end - t->range_begin;
  if (rows < GPUOS_ROTARY_PACKED * static_cast<int64_t>(GpuosWarpGroup::count())) {
    gpuos_for_rows<GpuosRotaryRow>(t, h);
    return;
  }
  int lanes = 1;
  while (lanes < GPUOS_WARP && GPUOS_ROTARY_PAIRS * lanes < h) lanes *= 2;
  const int side = blockDim.x / lanes, lane = threadIdx.x % lanes;
  if (static_cast<int>(threadIdx.x) >= side * lanes) return; /* a block not a multiple of lanes */
  GPUOS_ROLLED
  for (int64_t r = t->range_begin + threadIdx.x / lanes; r < t->range_end; r += side)
    gpuos_rotary_row<GPUOS_ROTARY_PAIRS>(t, r, lane, lanes);
}

#define GPUOS_DEFINE_ROTARY(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_rotary(t); }
