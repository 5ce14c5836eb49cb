/* attention.cuh: fused single-query attention decode.
 *
 * Contract (host encoding): in = (q [..., D], K [..., L, D], V [..., L, D][, lengths [...]]) with
 * equal leading dims after expansion (grouped-query heads and per-request lengths are stride-0
 * broadcasts); lengths is GPUOS_DTYPE_I32; out [..., D]; scalars[0] = scale;
 * 1 <= D <= GPUOS_ATTN_MAX_D, L >= 1 (the host validates both). Rows are numbered row-major over
 * q's leading dims; a task covers rows [range_begin, range_end). Per row, with n = L, or
 * min(lengths[row], L) when lengths is given (read on the device: it may change between runs):
 *   p = softmax(scale * K q) over keys [0, n), out = p^T V; out = 0 when n <= 0.
 *
 * Split-K in one block (flash-decoding): warp w takes keys w, w + W, ... with its own online
 * softmax (running max m, running sum s, output accumulator rescaled when m grows); lane i holds
 * output dims i, i + 32, ... in at most GPUOS_ATTN_DIMS_PER_LANE registers (fully unrolled, so no
 * local memory). The warps' states are then merged in warp order, so the result is deterministic.
 * Static shared memory: q (scaled) and the merged accumulator, 2 KiB, plus the block reductions. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

#define GPUOS_ATTN_MAX_D 256
#define GPUOS_ATTN_DIMS_PER_LANE (GPUOS_ATTN_MAX_D / GPUOS_WARP)

/* The [L, D] matrix of one row of a [..., L, D] ref: element (l, d) at byte address
 * key(l) + d * dstep. gpuos_seek moves it over the leading dims, numbered like q's rows. */
struct GpuosKeys {
  char* p;
  int64_t lstep;
  int64_t dstep;
  int dtype;
  const GpuosTensorRef* ref;

  __device__ __forceinline__ const char* key(int64_t l) const { return p + l * lstep; }
  __device__ __forceinline__ void advance(int d, int64_t i) { p += i * gpuos_step(*ref, d); }
};

__device__ __forceinline__ GpuosKeys gpuos_keys(const GpuosTensorRef& ref) {
  GpuosKeys k;
  k.p = reinterpret_cast<char*>(ref.data);
  k.lstep = gpuos_step(ref, ref.ndim - 2);
  k.dstep = gpuos_step(ref, ref.ndim - 1);
  k.dtype = ref.dtype;
  k.ref = &ref;
  return k;
}

/* One warp's online softmax over its keys: running max m, running sum s, and the output
 * accumulator of the dims its lane holds (lane i: dims i, i + 32, ...). */
struct GpuosAttnState {
  float m;
  float s;
  float acc[GPUOS_ATTN_DIMS_PER_LANE];
};

/* Fold keys warp, warp + warps, ... < l_len of one row into st, with N >= ceil(D / 32) dims per
 * lane. Each key's K and V elements are all loaded before any is used, so they are in flight
 * together; lanes past D load the key's first element instead (always valid) and drop it, which
 * keeps the loads branch-free. Pointers walk 32 dims at a time: offsets per dim would each stay
 * live across the loop. Past-D accumulators collect junk that is never stored. */
template <int N>
__device__ __forceinline__ void gpuos_attention_scan(const GpuosKeys& k, const GpuosKeys& v,
                                                     const float* q, int d_len, int64_t l_len,
                                                     GpuosAttnState& st) {
  const int lane = threadIdx.x % GPUOS_WARP, warps = blockDim.x / GPUOS_WARP;
  const int64_t kstep = k.dstep * GPUOS_WARP, vstep = v.dstep * GPUOS_WARP;
  GPUOS_ROLLED
  for (int64_t l = threadIdx.x / GPUOS_WARP; l < l_len; l += warps) {
    const char *krow = k.key(l), *vrow = v.key(l);
    const char *kp = krow + lane * k.dstep, *vp = vrow + lane * v.dstep;
    float kv[N], vv[N];
#pragma unroll
    for (int i = 0; i < N; ++i, kp += kstep, vp += vstep) {
      const bool in = lane + i * GPUOS_WARP < d_len;
      kv[i] = gpuos_load_ptr(in ? kp : krow, k.dtype);
      vv[i] = gpuos_load_ptr(in ? vp : vrow, v.dtype);
    }
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dot += lane + i * GPUOS_WARP < d_len ? q[lane + i * GPUOS_WARP] * kv[i] : 0.0f;
    }
    dot = gpuos_warp_sum(dot);
    const float m_new = fmaxf(st.m, dot), alpha = gpuos_exp_diff(st.m, m_new);
    const float p = gpuos_exp_diff(dot, m_new);
    st.s = st.s * alpha + p;
#pragma unroll
    for (int i = 0; i < N; ++i) st.acc[i] = st.acc[i] * alpha + p * vv[i];
    st.m = m_new;
  }
}

/* One row; all threads of the block call it together. */
__device__ __forceinline__ void gpuos_attention_row(const GpuosTask* t, int64_t r, float* q,
                                                    float* merged) {
  const int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  const int d_len = static_cast<int>(gpuos_row_len(t->in[0]));
  /* Without lengths, in[3] is an unused (zeroed) ref: seeking its row moves nothing. */
  GpuosRow qr = gpuos_vector(t->in[0]), out = gpuos_vector(t->out), len = gpuos_vector(t->in[3]);
  GpuosKeys k = gpuos_keys(t->in[1]), v = gpuos_keys(t->in[2]);
  gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, qr, out, k, v, len);
  int64_t l_len = t->in[1].sizes[t->in[1].ndim - 2];
  if (t->num_inputs > 3) {
    const int64_t n = gpuos_load_i32(len.p);
    l_len = n < 0 ? 0 : (n < l_len ? n : l_len);
  }
  __syncthreads(); /* the previous row's readers of q and merged are done */
  GPUOS_ROLLED
  for (int d = threadIdx.x; d < d_len; d += blockDim.x) q[d] = t->scalars[0] * qr.load(d);
  __syncthreads();

  GpuosAttnState st;
  st.m = gpuos_neg_inf();
  st.s = 0.0f;
#pragma unroll
  for (int i = 0; i < GPUOS_ATTN_DIMS_PER_LANE; ++i) st.acc[i] = 0.0f;
  /* Few versions of the key loop: dims per lane rounded up to a power of two. */
  if (d_len <= GPUOS_WARP) {
    gpuos_attention_scan<1>(k, v, q, d_len, l_len, st);
  } else if (d_len <= 2 * GPUOS_WARP) {
    gpuos_attention_scan<2>(k, v, q, d_len, l_len, st);
  } else if (d_len <= 4 * GPUOS_WARP) {
    gpuos_attention_scan<4>(k, v, q, d_len, l_len, st);
  } else {
    gpuos_attention_scan<GPUOS_ATTN_DIMS_PER_LANE>(k, v, q, d_len, l_len, st);
  }

  /* Merge: rescale every warp to the block max; s is uniform in a warp, so lane 0 counts it. */
  const float m_all = gpuos_block_max(st.m), f = gpuos_exp_diff(st.m, m_all);
  const float s_all = gpuos_block_sum(lane == 0 ? st.s * f : 0.0f);
  GPUOS_ROLLED
  for (int w = 0; w < blockDim.x / GPUOS_WARP; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < GPUOS_ATTN_DIMS_PER_LANE; ++i) {
        const int d = lane + i * GPUOS_WARP;
        if (d < d_len) merged[d] = (w == 0 ? 0.0f : merged[d]) + st.acc[i] * f;
      }
    }
    __syncthreads();
  }
  /* No key: merged and s_all are both 0. */
  GPUOS_ROLLED
  for (int d = threadIdx.x; d < d_len; d += blockDim.x)
    out.store(d, l_len > 0 ? gpuos_div(merged[d], s_all) : 0.0f);
}

__device__ __forceinline__ void gpuos_attention_decode(const GpuosTask* t) {
  __shared__ float q[GPUOS_ATTN_MAX_D];
  __shared__ float merged[GPUOS_ATTN_MAX_D];
  GPUOS_ROLLED
  for (int64_t r = t->range_begin; r < t->range_end; ++r) gpuos_attention_row(t, r, q, merged);
}

#define GPUOS_DEFINE_ATTENTION_DECODE(SYMBOL) \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) { gpuos_attention_decode(t); }
