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

struct GpuosRotaryRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
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
    for (int64_t j = G::rank(); j < h; j += G::size()) {
      const float x1 = x.load(j), x2 = x.load(j + h), cj = c.load(j), sj = s.load(j);
      y.store(j, x1 * cj - x2 * sj);
      y.store(j + h, x2 * cj + x1 * sj);
    }
  }
};

#define GPUOS_DEFINE_ROTARY(SYMBOL)                                 \
  GPUOS_AWAITING_OPERATOR(SYMBOL) {                                 \
    gpuos_for_rows<GpuosRotaryRow>(t, gpuos_row_len(t->in[0]) / 2); \
  }
