/* scatter.cuh: rows moved by an index tensor: scatter_rows writes rows of src into the rows of out
 * that the index names (KV-cache appends); gather_rows reads the rows of a table that the index
 * names (embedding lookups).
 *
 * scatter_rows contract (host encoding): in = (src [..., D], index [...]) with index GPUOS_DTYPE_I32, expanded
 * to src's leading dims; out [..., D] is the caller's tensor (the cache), updated in place: only
 * the rows named are written. src's rows are numbered row-major over its leading dims, out's over
 * its own; D >= 1. A task covers src rows [range_begin, range_end). For each, with n = index[r]
 * (read on the device: the host rewrites it between runs of a fixed program):
 *   0 <= n < rows(out): out row n = src row r (converted to out's dtype);
 *   otherwise (padding rows, index -1): nothing.
 * Two src rows naming one out row race: one of them wins. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

struct GpuosScatterRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), n = gpuos_vector(t->in[1]);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, n);
    /* rows(out) = numel / D, compared by multiplying: a 64-bit division is a call. */
    const int64_t dst = gpuos_load_i32(n.p), d_len = gpuos_row_len(t->out);
    if (dst < 0 || dst * d_len >= t->out.numel) return;
    const GpuosRow y = gpuos_row(t->out, dst);
    gpuos_row_each<G>(x, d_len, [&](int64_t j, float v) { y.store(j, v); });
  }
};

#define GPUOS_DEFINE_SCATTER_ROWS(SYMBOL)                        \
  GPUOS_AWAITING_OPERATOR(SYMBOL) {                              \
    gpuos_for_rows<GpuosScatterRow>(t, gpuos_row_len(t->in[0])); \
  }

/* gather_rows contract (host encoding): in = (table [..., D], index [...]) with index
 * GPUOS_DTYPE_I32; out [..., D] has index's dims then D. The table's rows are numbered row-major
 * over its leading dims, out's over its own; a task covers out rows [range_begin, range_end).
 * For each, with n = index[r] (read on the device: it changes between runs of a fixed program):
 *   0 <= n < rows(table): out row r = table row n (converted to out's dtype);
 *   otherwise (padding rows): out row r = 0. */
struct GpuosGatherRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow y = gpuos_vector(t->out), n = gpuos_vector(t->in[1]);
    gpuos_seek(t->out, gpuos_row_dims(t->out), r, y, n);
    const int64_t src = gpuos_load_i32(n.p), d_len = gpuos_row_len(t->out);
    const bool in = src >= 0 && src * d_len < t->in[0].numel; /* no 64-bit division */
    const GpuosRow x = gpuos_row(t->in[0], in ? src : 0);
    gpuos_row_each<G>(x, d_len, [&](int64_t j, float v) { y.store(j, in ? v : 0.0f); });
  }
};

#define GPUOS_DEFINE_GATHER_ROWS(SYMBOL)                      \
  GPUOS_AWAITING_OPERATOR(SYMBOL) {                           \
    gpuos_for_rows<GpuosGatherRow>(t, gpuos_row_len(t->out)); \
  }
