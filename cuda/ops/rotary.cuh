/* rotary.cuh: rotary position embedding, rotate-half (Llama / Hugging Face) form.
 *
 * Contract (host encoding): in = (x [..., D], cos [..., D/2], sin [..., D/2]) with cos/sin
 * expanded to x's leading dims; out has x's shape; D is even; rows are numbered row-major over the
 * leading dims; a task covers rows [range_begin, range_end). With h = D/2, for j < h:
 *   out[j]     = x[j]     * cos[j] - x[j + h] * sin[j]
 *   out[j + h] = x[j + h] * cos[j] + x[j]     * sin[j]
 * Each thread reads both halves of its pair before writing, so out may alias x. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

struct GpuosRotaryRow {
  template <class G>
  __device__ static void run(const GpuosTask* t, int64_t r) {
    GpuosRow x = gpuos_vector(t->in[0]), c = gpuos_vector(t->in[1]), s = gpuos_vector(t->in[2]);
    GpuosRow y = gpuos_vector(t->out);
    gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, x, c, s, y);
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
  extern "C" __device__ void SYMBOL(const GpuosTask* t) {           \
    gpuos_for_rows<GpuosRotaryRow>(t, gpuos_row_len(t->in[0]) / 2); \
  }
