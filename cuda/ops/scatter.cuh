/* scatter.cuh: rows of src written into rows of out that an index tensor names (KV-cache appends).
 *
 * Contract (host encoding): in = (src [..., D], index [...]) with index GPUOS_DTYPE_I32, expanded
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

#define GPUOS_DEFINE_SCATTER_ROWS(SYMBOL)                          \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) {          \
    gpuos_for_rows<GpuosScatterRow>(t, gpuos_row_len(t->in[0]));   \
  }
