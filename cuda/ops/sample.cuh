/* sample.cuh: next-token choice for rows of logits on the device (temperature, top-k, top-p),
 * one token id per row; the same rule as gpuos_core/sampler.py, which the CPU backend runs.
 *
 * Contract (host encoding): in = (logits [..., V], params [..., 3] fp32, rng [..., 3] int32) with
 * equal leading dims after expansion; out int32 [...] (the leading dims). Rows are numbered
 * row-major over the leading dims; a task covers rows [range_begin, range_end). Per row:
 * params = (temperature T, top_p, top_k), rng = (seed low 32 bits, seed high 32 bits, step), as
 * device tensors because they change every step. Logits may be -inf (masked), never NaN or +inf.
 *
 * The rule (m = max logit, k = (int)top_k):
 *   1. T <= 0 (or NaN), k == 1, or no finite logit: the lowest index of m (torch.argmax).
 *   2. The window C = {j : l_j >= m - 32 T} (fp32: 32 T is exact, one rounding in the subtraction).
 *   3. top-k (k > 1): S = the j in C with l_j >= the k-th largest logit of C (ties all kept);
 *      all of C when C has at most k tokens.
 *   4. top-p (top_p < 1): w_j = exp((l_j - m) / T); S = the j in S with l_j >= v*, v* the largest
 *      logit with  sum(w_j : j in S, l_j >= v*) >= top_p * sum(w_j : j in S)  (ties all kept).
 *   5. Draw (Gumbel-max): x = Philox4x32-10(key = seed, counter = (j / 4, step, 0, 0)) word j % 4,
 *      u = ((x >> 9) + 0.5) * 2^-23 in (0, 1), g = -log(-log(u)),
 *      token = argmax over S of (l_j - m) + T * g_j, lowest index on ties.
 * Gumbel-max samples softmax(l / T) restricted to S, and a row's draw depends only on its own
 * seed, step and logits: a request gets the same token whatever it is batched with. The window
 * changes nothing in the draw (the noise spans 19.4 T, so a token 32 T below the max never wins)
 * and leaves out of top-k / top-p at most V e^-32 of the max token's probability (under fp32
 * rounding for V < 10^6). Selection compares logits exactly; steps 4-5 agree with the torch
 * mirror except when masses or noisy keys tie within float rounding (logf vs torch.log differ in
 * the last bit, masses are summed in other orders).
 *
 * One block per row, no sort: a pass finds m and its index; top-k and top-p each find their
 * threshold by a radix search over order-preserving 32-bit keys of the logits in C, MSB first,
 * 8-bit digits starting at the highest bit where the window's keys differ (fp32 at most 4 passes,
 * fp16 3, bf16 2; a count search stops early when a bin holds exactly the tokens still needed),
 * histogramming only the tokens still in the running into 256 shared bins: counts for top-k,
 * for top-p masses in 64-bit fixed point (w * 2^40, integer sums: the result does not depend on
 * the order of the atomics). A last pass draws over the kept set, one Philox call per group of
 * four tokens that holds a kept one. Static shared memory: 2328 bytes (2 KiB of bins, the
 * search's broadcast words, two block reductions' partials). Math: expf/logf (accurate, no
 * calls), the subtraction, product and sum of the key unfused (__fsub_rn etc.) so that torch's
 * separately rounded ops give the same bits; 1 / T by __fdividef (masses only).
 * Trace marks (bench/step_trace.py), the record's last row: 0 its max found, 1 its parameters
 * read, 2 its token stored. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

#define GPUOS_SAMPLE_WINDOW 32.0f   /* C: logits at most this many temperatures below the max */
#define GPUOS_SAMPLE_BINS 256       /* radix digit: 8 bits */
#define GPUOS_SAMPLE_MASS 0x1p40f   /* fixed-point scale of w_j <= 1 (sums of 2^23 tokens fit) */
#define GPUOS_SAMPLE_NONE 0xffffffffu

/* ---- Philox4x32-10 (Salmon et al., SC'11; the Random123 and curand constants) ---------------- */

__device__ __forceinline__ uint4 gpuos_philox(uint4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

/* ---- keys and block reductions --------------------------------------------------------------- */

/* Unsigned key ordered like the float (-0 counts as +0, as float comparisons treat them). */
__device__ __forceinline__ unsigned int gpuos_order_key(float v) {
  const unsigned int b = __float_as_uint(__fadd_rn(v, 0.0f));
  return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}

/* Minimum over the 32 lanes of a warp: one instruction from sm_80, shuffles before. */
__device__ __forceinline__ unsigned int gpuos_warp_min_u32(unsigned int v) {
#if GPUOS_SM80
  return __reduce_min_sync(GPUOS_ALL_LANES, v);
#else
#pragma unroll
  for (int o = GPUOS_WARP / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(GPUOS_ALL_LANES, v, o));
  return v;
#endif
}

/* Minimum over the block (same calling rules as gpuos_block_sum). */
__device__ __forceinline__ unsigned int gpuos_block_min_u32(unsigned int v) {
  __shared__ unsigned int partial[GPUOS_WARP];
  const unsigned int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  v = gpuos_warp_min_u32(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return gpuos_warp_min_u32(lane < blockDim.x / GPUOS_WARP ? partial[lane] : GPUOS_SAMPLE_NONE);
}

/* The lowest index j among the threads whose value v is the block's maximum m (set for every
 * thread); each thread passes its own best (v, j), j the lowest index of its v
 * (GPUOS_SAMPLE_NONE when it saw nothing). */
__device__ __forceinline__ unsigned int gpuos_block_argmax(float v, unsigned int j, float& m) {
  m = gpuos_block_max(v);
  return gpuos_block_min_u32(v == m ? j : GPUOS_SAMPLE_NONE);
}

/* ---- one row --------------------------------------------------------------------------------- */

/* What the passes over one row share: the logits and the row's draw parameters. */
struct GpuosSampleRow {
  GpuosRow x;
  int64_t n;
  float m;       /* max logit */
  float temp;    /* T > 0 */
  float inv_t;   /* 1 / T */
  unsigned int top;  /* gpuos_order_key(m) */
};

/* The radix search's bins and what warp 0 decides after each pass, for the whole block. A bin's
 * weight is hi * 2^32 + lo: two words with native 32-bit atomics (a 64-bit shared atomicAdd is a
 * compare-and-swap loop on sm_90), the low word's carries added to the high one exactly. */
struct GpuosSampleShared {
  unsigned int lo[GPUOS_SAMPLE_BINS];
  unsigned int hi[GPUOS_SAMPLE_BINS];
  unsigned long long above;   /* weight of the tokens above the chosen bin */
  unsigned long long target;  /* weight the kept set must reach */
  unsigned int bin;           /* chosen bin, or GPUOS_SAMPLE_NONE: everything is kept */
  int exact;                  /* the chosen bin holds exactly the weight still needed */
};

/* Adds w to bin b (a count needs only the low word: fewer than 2^32 tokens). */
template <bool MASS>
__device__ __forceinline__ void gpuos_sample_bin_add(GpuosSampleShared& sh, unsigned int b,
                                                     unsigned long long w) {
  const unsigned int lo = static_cast<unsigned int>(w);
  if (!MASS) {
    atomicAdd(&sh.lo[b], lo);
    return;
  }
  const unsigned int old = atomicAdd(&sh.lo[b], lo);
  const unsigned int hi = static_cast<unsigned int>(w >> 32) + (old + lo < old ? 1u : 0u);
  if (hi) atomicAdd(&sh.hi[b], hi);
}

__device__ __forceinline__ unsigned long long gpuos_sample_bin(const GpuosSampleShared& sh, int b) {
  return (static_cast<unsigned long long>(sh.hi[b]) << 32) | sh.lo[b];
}

/* Warp 0, after a histogram pass: the bin, from the top, where the weight above it plus its own
 * first reaches the target. On the first pass the target of a mass search is set from the total
 * weight (ceil(top_p * total), at least 1). Lane i sums bins 8i..8i+7; a suffix scan over lanes
 * finds the one lane whose bins cross the target. */
__device__ __forceinline__ void gpuos_sample_pick(GpuosSampleShared& sh, bool first, bool mass,
                                                  float top_p) {
  const unsigned int lane = threadIdx.x;
  unsigned long long part = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) part += gpuos_sample_bin(sh, 8 * lane + i);
  unsigned long long incl = part; /* weight of lanes lane..31: their bins are higher */
#pragma unroll
  for (int o = 1; o < GPUOS_WARP; o <<= 1) {
    const unsigned long long up = __shfl_down_sync(GPUOS_ALL_LANES, incl, o);
    if (lane + o < GPUOS_WARP) incl += up;
  }
  const unsigned long long total = __shfl_sync(GPUOS_ALL_LANES, incl, 0);
  const unsigned long long above = sh.above;
  unsigned long long target = sh.target;
  if (first && mass) {
    const double want = __dmul_rn(static_cast<double>(top_p), __ull2double_rn(total));
    target = max(1ull, __double2ull_ru(want));
  }
  __syncwarp(); /* every lane has read sh before one writes it */
  const unsigned long long before = above + incl - part;
  if (lane == 0) {
    sh.target = target;
    if (above + total < target) sh.bin = GPUOS_SAMPLE_NONE;
  }
  if (before < target && target <= before + part) {
    unsigned long long acc = before;
    GPUOS_ROLLED
    for (int i = 7; i >= 0; --i) {
      const unsigned long long w = gpuos_sample_bin(sh, 8 * lane + i);
      if (acc + w >= target) {
        sh.bin = 8 * lane + i;
        sh.above = acc;
        sh.exact = acc + w == target;
        break;
      }
      acc += w;
    }
  }
}

/* The key threshold of the kept set: the largest key t >= lo such that the tokens with keys in
 * [t, top] weigh at least the target (counts: target k; MASS: ceil(top_p * their total), weights
 * w_j * 2^40). Radix search as in the header comment; all threads call it. `low` is the number
 * of low key bits the dtype leaves zero (no digit needed there). */
template <bool MASS>
__device__ __forceinline__ unsigned int gpuos_sample_threshold(const GpuosSampleRow& s,
                                                               unsigned int lo, float top_p,
                                                               unsigned long long k, int low,
                                                               GpuosSampleShared& sh) {
  const unsigned int diff = lo ^ s.top;
  if (diff == 0) return lo; /* every candidate has the max's key */
  const int high = 31 - __clz(diff);
  unsigned int fixed = high == 31 ? 0u : ~0u << (high + 1); /* key bits decided so far */
  unsigned int prefix = s.top;
  int shift = max(high - 7, 0);
  if (threadIdx.x == 0) sh.above = 0, sh.target = k;
  for (bool first = true;; first = false) {
    GPUOS_ROLLED
    for (int b = threadIdx.x; b < GPUOS_SAMPLE_BINS; b += blockDim.x) sh.lo[b] = sh.hi[b] = 0;
    __syncthreads();
    const unsigned int want = prefix & fixed;
    gpuos_row_each<GpuosBlockGroup, GPUOS_ILP>(s.x, s.n, [&](int64_t, float v) {
      const unsigned int key = gpuos_order_key(v);
      if (key >= lo && (key & fixed) == want) {
        const unsigned long long w =
            MASS ? __float2ull_rz(expf((v - s.m) * s.inv_t) * GPUOS_SAMPLE_MASS) : 1ull;
        gpuos_sample_bin_add<MASS>(sh, (key >> shift) & (GPUOS_SAMPLE_BINS - 1), w);
      }
    });
    __syncthreads();
    if (threadIdx.x < GPUOS_WARP) gpuos_sample_pick(sh, first, MASS, top_p);
    __syncthreads();
    const unsigned int bin = sh.bin;
    const bool exact = sh.exact;
    if (bin == GPUOS_SAMPLE_NONE) return lo;
    prefix = want | (bin << shift);
    fixed = ~0u << shift;
    if (exact || shift <= low) return max(prefix, lo);
    shift = max(shift - 8, 0);
  }
}

/* (l - m) + T * g for the uniform word x, rounded op by op like the torch mirror. */
__device__ __forceinline__ float gpuos_gumbel_key(const GpuosSampleRow& s, float v,
                                                  unsigned int x) {
  const float u = __fmul_rn(__fadd_rn(__uint2float_rn(x >> 9), 0.5f), 0x1p-23f);
  return __fadd_rn(__fsub_rn(v, s.m), __fmul_rn(s.temp, -logf(-logf(u))));
}

/* Group g of four tokens (values v) into the draw's best key and its index: one Philox call,
 * made only when one of them is kept. */
__device__ __forceinline__ void gpuos_sample_group(const GpuosSampleRow& s, unsigned int lo,
                                                   uint2 seed, unsigned int step, int64_t g,
                                                   const float (&v)[4], float& best,
                                                   unsigned int& best_j) {
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) any |= 4 * g + i < s.n && gpuos_order_key(v[i]) >= lo;
  if (!any) return;
  const uint4 r =
      gpuos_philox(make_uint4(static_cast<unsigned int>(g), step, 0u, 0u), seed.x, seed.y);
  const unsigned int x[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (4 * g + i < s.n && gpuos_order_key(v[i]) >= lo) {
      const float key = gpuos_gumbel_key(s, v[i], x[i]);
      if (key > best || best_j == GPUOS_SAMPLE_NONE) best = key, best_j = 4 * g + i;
    }
  }
}

/* Step 5: the Gumbel-max draw over the tokens with key >= lo. Threads take groups of four
 * tokens in increasing order: a contiguous, aligned row's whole groups one vector load each
 * (gpuos_row_quads, so a warp's loads stay coalesced), then the rest (a partial last group, or
 * every group of another layout) GPUOS_ILP groups of single loads in flight. */
__device__ __forceinline__ unsigned int gpuos_sample_draw(const GpuosSampleRow& s, unsigned int lo,
                                                          uint2 seed, unsigned int step) {
  float best = gpuos_neg_inf();
  unsigned int best_j = GPUOS_SAMPLE_NONE;
  const int64_t groups = (s.n + 3) / 4, quads = gpuos_row_head(s.x, 4) == 0 ? s.n / 4 : 0;
  gpuos_row_quads<GpuosBlockGroup, GPUOS_ILP>(s.x, quads, [&](int64_t g, const float(&v)[4]) {
    gpuos_sample_group(s, lo, seed, step, g, v, best, best_j);
  });
  GPUOS_ROLLED
  for (int64_t g0 = quads + threadIdx.x; g0 < groups; g0 += GPUOS_ILP * blockDim.x) {
    float v[GPUOS_ILP][4];
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t g = g0 + u * blockDim.x < groups ? g0 + u * blockDim.x : g0;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[u][i] = s.x.load(min(4 * g + i, s.n - 1));
    }
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t g = g0 + u * blockDim.x;
      if (g < groups) gpuos_sample_group(s, lo, seed, step, g, v[u], best, best_j);
    }
  }
  float key;
  return gpuos_block_argmax(best, best_j, key);
}

/* Step 1's pass: the max logit and its lowest index, for every thread. */
__device__ __forceinline__ unsigned int gpuos_sample_argmax(const GpuosRow& x, int64_t n,
                                                            float& m) {
  float best = gpuos_neg_inf();
  unsigned int best_j = GPUOS_SAMPLE_NONE;
  gpuos_row_each<GpuosBlockGroup, 2 * GPUOS_ILP>(x, n, [&](int64_t j, float v) {
    if (v > best || best_j == GPUOS_SAMPLE_NONE) best = v, best_j = static_cast<unsigned int>(j);
  });
  return gpuos_block_argmax(best, best_j, m);
}

/* Low key bits a dtype leaves zero when widened to fp32. */
__device__ __forceinline__ int gpuos_zero_bits(int dtype) {
  return dtype == GPUOS_DTYPE_BF16 ? 16 : dtype == GPUOS_DTYPE_F16 ? 13 : 0;
}

/* One row, by all threads of the block. */
__device__ __forceinline__ void gpuos_sample_row(const GpuosTask* t, int64_t r,
                                                 GpuosSampleShared& sh) {
  GpuosSampleRow s;
  GpuosRow params = gpuos_vector(t->in[1]), rng = gpuos_vector(t->in[2]);
  s.x = gpuos_vector(t->in[0]);
  gpuos_seek(t->in[0], gpuos_row_dims(t->in[0]), r, s.x, params, rng);
  s.n = gpuos_row_len(t->in[0]);
  unsigned int token = gpuos_sample_argmax(s.x, s.n, s.m);
  GPUOS_MARK(0);
  s.temp = params.load(0);
  const float top_p = params.load(1);
  const int k = __float2int_rz(params.load(2));
  GPUOS_MARK(1);
  const bool finite = s.m > gpuos_neg_inf() && s.m < -gpuos_neg_inf();
  if (s.temp > 0.0f && k != 1 && finite) {
    s.inv_t = gpuos_div(1.0f, s.temp);
    s.top = gpuos_order_key(s.m);
    const int low = gpuos_zero_bits(s.x.dtype);
    unsigned int lo = gpuos_order_key(__fsub_rn(s.m, __fmul_rn(GPUOS_SAMPLE_WINDOW, s.temp)));
    if (k > 1) lo = gpuos_sample_threshold<false>(s, lo, 1.0f, k, low, sh);
    if (top_p < 1.0f) lo = gpuos_sample_threshold<true>(s, lo, top_p, 0, low, sh);
    const uint2 seed = make_uint2(gpuos_load_i32(rng.p), gpuos_load_i32(rng.p + rng.step));
    token = gpuos_sample_draw(s, lo, seed, gpuos_load_i32(rng.p + 2 * rng.step));
  }
  if (threadIdx.x == 0) {
    *reinterpret_cast<int*>(gpuos_ptr(t->out, gpuos_offset(t->out, r))) = static_cast<int>(token);
  }
  GPUOS_MARK(2);
}

__device__ __forceinline__ void gpuos_sample(const GpuosTask* t) {
  __shared__ GpuosSampleShared sh;
  GPUOS_ROLLED
  for (int64_t r = t->range_begin; r < t->range_end; ++r) gpuos_sample_row(t, r, sh);
}

#define GPUOS_DEFINE_SAMPLE_TOKENS(SYMBOL) \
  GPUOS_AWAITING_OPERATOR(SYMBOL) { gpuos_sample(t); }
