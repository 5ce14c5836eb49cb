/* linear.cuh: out = x W^T (+ bias), the matmuls of a decode step, on tensor cores.
 *
 * Contract (host encoding: gpuos_core/families.py, LinearFamily and LinearPlan):
 *   in[0] = x [..., K]: M rows, numbered row-major over its leading dims;
 *   in[1] = W [N, K], Hugging Face's layout (one row per output);
 *   in[2] = bias [N], or an empty tensor for none; x, W and bias share one float dtype;
 *   in[3] = workspace, int32: empty when K is not split (S = 1), else T arrival counters (zero
 *           between tasks: the last arrival resets its counter), padded to a multiple of 4
 *           words, then S * T partial blocks of P x BN fp32, T = MB * NT tiles; a trailing dim
 *           of 1 more (in parts mode too) makes the plan wide;
 *   out [..., N] with x's leading dims, any float dtype; computed in fp32.
 * Activation (the catalogue's linear_gelu and linear_gelu_tanh): out holds gelu (erf or tanh
 * form; gpuos_linear_act) of each final value, in fp32 before out's rounding: an MLP's up
 * projection without a stage of its own for its gelu.
 * Gated (the catalogue's linear_silu_glu): W's rows come in pairs, a gate's then its up's, and
 * out [..., N / 2] holds silu(gate) * up of each pair (N even; gpuos_linear_silu): Llama's up
 * projection and SwiGLU in one stage. Every path sums a pair's two outputs in one thread (the
 * tensor-core lanes hold outputs 2c, 2c + 1; the combine's quads two pairs; the CUDA-core path
 * takes pairs).
 * Parts mode (GPUOS_DEFINE_LINEAR_PARTS, the catalogue's linear_parts): out is [S, ..., N], one
 * more leading dim than x, and in[3] is empty: split s stores its partial sums over its k range as
 * rows s * M .. s * M + M - 1 of out, split 0 with the bias added, and no split combines them. Its
 * consumer sums the S parts in split order (add_layernorm, add_rmsnorm: addnorm.cuh), so K is
 * split without the count-in and the last split's round trips to L2.
 * Tiles: an m-block is BM rows of x (MB = ceil(M / BM)), an n-tile BN outputs (NT = ceil(N / BN)),
 * P = min(M, BM) rounded up to 16; BM = BN = 64, or 128 in a wide plan (prefill rows: each
 * product's bytes from L2 halved). K is cut into S splits of kch steps of 32 (kch =
 * ceil(ceil(K / 32) / S) rounded up to 8; every split has at least one step); S follows from the
 * workspace's length.
 * A work item is one (m-block, split, n-tile), numbered i = (nt * S + s) * MB + mb (neighbouring
 * items share a tile of W, or a tile's splits); a record covers items [range_begin, range_end).
 *
 * Split-K combine, deterministic: every split stores its fp32 partial block, and its block adds
 * one to the tile's counter (gpuos_count_in: wraps at S, so the counter is back to zero after the
 * last); the block that sees S - 1 sums the S blocks in split order, adds the bias and writes
 * out. A task must not run concurrently with itself (a second run would share counters).
 *
 * Tensor-core path (fp16/bf16, K > 0 and K % 8 == 0, 16-byte aligned rows of x and W, rows of x
 * and of out one stride apart, blockDim >= 256, GPUOS_LINEAR_SMEM bytes of dynamic shared memory):
 * 8 warps each own 8 rows of the n-tile and all rows of x (at 64 rows of x: a 2 x 4 grid, each warp
 * 32 rows of x and 16 of the n-tile); mma.sync m16n8k16 with x as A (m16 tiles of rows, 1 to 4
 * by the m-block's size) and W as B, so that a warp's W fragment is one 16-byte shared-memory load
 * per lane per step: lane (g, q) reads W[row g][k + 8q .. k + 8q + 7] and x likewise, and the two
 * products of a step read those 8 values in an order permuted consistently for A and B (the dot
 * product does not care).
 * On sm_90a (GPUOS_WGMMA) the 64-row m-blocks take warpgroup products instead: wgmma m64n32k16
 * with x as A and W as B, both read by the tensor cores from the stage in the 128-byte swizzle,
 * warpgroup w taking outputs 32 w .. of the tile for all 64 rows; no shared-memory loads into
 * registers, and the next stage's copies are issued while the products run. A wide plan's tiles
 * run there alone (elsewhere, and where out does not take pairs or N is odd, on CUDA cores):
 * wgmma m64n128k16, warpgroup w taking rows 64 w .. and all 128 outputs (64 accumulators a lane),
 * stages of one step in the 64-byte swizzle (four fit), W cached as x is (its m-blocks read it).
 * Memory: W and x stream through a pipeline of stages in the worker's dynamic shared memory
 * (cp.async.cg: L2, never a stale L1 line; GpuosLinearPipe), running on across the items of a
 * record, so that an item's epilogue overlaps the next item's loads; where W is settled
 * (gpuos_settled), its first stages are issued before the wait for x. Registers: 128 (the
 * NVRTC cap).
 * Anything else (fp32, odd strides or alignment, K = 0, small blocks) takes the CUDA-core path:
 * a thread per two outputs, same items, same combine. The three paths (decode tiles, wide tiles,
 * CUDA cores) are functions of their own (gpuos_linear_narrow, _wide, _generic).
 * Trace marks (bench/step_trace.py), tensor-core path: 0 plan, 6 W's first stages issued, 2 the
 * record's first stage in, 3 an item's products, 1 its values stored, 4 counted in, 5 combined,
 * 7 the combine's first quad summed. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */
#include "ops/math.cuh"

#define GPUOS_LINEAR_BM 64          /* rows of x per m-block */
#define GPUOS_LINEAR_BN 64          /* outputs per n-tile */
#define GPUOS_LINEAR_WIDE 128       /* rows and outputs of a wide plan's tile */
#define GPUOS_LINEAR_WARPS 8        /* warps of the tensor-core path: 8 rows of W each */
#define GPUOS_LINEAR_KSTEP 32       /* k per step: two m16n8k16 products */
#define GPUOS_LINEAR_STEP_ALIGN 8   /* a split's steps come in multiples of this */
#define GPUOS_LINEAR_PART_ROWS 16   /* partial blocks have rows rounded up to this */
#define GPUOS_LINEAR_MMA_THREADS (GPUOS_LINEAR_WARPS * GPUOS_WARP)
/* Dynamic shared memory the tensor-core path's pipeline takes. */
#define GPUOS_LINEAR_SMEM GPUOS_DYNAMIC_SMEM

/* What one task's records share, computed once per record by thread 0 into shared memory. */
struct GpuosLinearPlan {
  int m, n, k;          /* rows of x, outputs, inner dim */
  int bm, bn;           /* rows of an m-block and outputs of an n-tile: 64, or 128 when wide */
  int mblocks, ntiles;  /* m-blocks and n-tiles */
  int splits, kch;      /* K splits and steps per split */
  int prows;            /* rows of a partial block */
  int64_t xrs, ors;     /* elements between rows of x and of out, -1 when no one stride serves */
  bool fast;            /* the tensor-core path applies */
  bool parts;           /* parts mode: the splits' partial sums are the output */
  bool wide;            /* tiles of 128 x 128 (in[3] has a trailing dim of 1) */
};

/* The activation an operator applies to its final values (not to partial sums). */
#define GPUOS_LINEAR_IDENTITY 0
#define GPUOS_LINEAR_GELU 1
#define GPUOS_LINEAR_GELU_TANH 2
#define GPUOS_LINEAR_SILU_GLU 3 /* on pairs of outputs: emit2, gpuos_linear_final2 */

/* v sigmoid(z) = v / (1 + e^-z), on the special-function unit: one ex2.approx and one
 * __fdividef (relative error ~2^-21, against fp32's 2^-24 and the outputs' 16-bit rounding). The
 * epilogues' activations take this form rather than math.cuh's: tanhf, expf and IEEE division are
 * ~3x the instructions with range branches, and a wide tile runs them for 64 outputs a lane from
 * code that is cold at every record (a 512-row GPT-2 up projection spent 14.6 us of a 40 us
 * record in its stores, against 2.5 us without the gelu; H200, s248). */
__device__ __forceinline__ float gpuos_linear_sigmoid_times(float v, float z) {
  return gpuos_div(v, 1.0f + gpuos_exp2(-GPUOS_LOG2E * z));
}

/* torch's silu: v sigmoid(v). */
__device__ __forceinline__ float gpuos_linear_silu(float v) {
  return gpuos_linear_sigmoid_times(v, v);
}

/* The activation of final values: gelu as math.cuh computes it, and torch's tanh form as
 * v sigmoid(2 u), u = sqrt(2 / pi) (v + 0.044715 v^3): the same function, since
 * (1 + tanh u) / 2 = sigmoid(2 u). */
template <int ACT>
__device__ __forceinline__ float gpuos_linear_act(float v) {
  if constexpr (ACT == GPUOS_LINEAR_GELU) return gpuos_gelu(v);
  if constexpr (ACT == GPUOS_LINEAR_GELU_TANH) {
    return gpuos_linear_sigmoid_times(v, 1.5957691216057308f * v * (1.0f + 0.044715f * v * v));
  }
  return v;
}

/* Words of the workspace's counters for `tiles` tiles: rounded up so that the partial blocks
 * after them are 16-byte aligned. */
__device__ __forceinline__ unsigned int gpuos_linear_counters(unsigned int tiles) {
  return (tiles + 3u) & ~3u;
}

/* One work item, decoded. */
struct GpuosLinearItem {
  int mb, s, nt;  /* m-block, split, n-tile */
  int rows;       /* rows of x in the m-block */
  int k0, k1;     /* its k range */
  int steps;      /* steps over it, padded to GPUOS_LINEAR_STEP_ALIGN (the pad reads zeros) */
};

/* Elements between consecutive rows of `ref` (rows row-major over all dims but the last) when one
 * stride serves them all, else -1; 0 when there is at most one row. */
__device__ __forceinline__ int64_t gpuos_linear_row_stride(const GpuosTensorRef& ref) {
  int64_t stride = 0, span = 1;
  bool seen = false, ok = true;
  GPUOS_ROLLED
  for (int d = ref.ndim - 2; d >= 0; --d) {
    if (ref.sizes[d] == 1) continue;
    if (!seen) stride = ref.strides[d], seen = true;
    ok = ok && ref.strides[d] == stride * span;
    span *= ref.sizes[d];
  }
  return ok ? stride : -1;
}

__device__ __forceinline__ bool gpuos_aligned16(uint64_t address) { return (address & 15u) == 0; }

/* Whether two neighbouring outputs of `out` (rows `ors` elements apart) can take one store of
 * twice their width: 16-bit or fp32 outputs, unit column stride, even row stride, data aligned to
 * that width. */
__device__ __forceinline__ bool gpuos_linear_pairs(const GpuosTensorRef& out, int64_t ors) {
  const int size = gpuos_dtype_size(out.dtype);
  return (size == 2 || size == 4) && out.strides[out.ndim - 1] == 1 && ors % 2 == 0 &&
         (out.data & (2u * size - 1u)) == 0;
}

/* Whether the tensor-core path can run the task: see the header comment. */
__device__ __forceinline__ bool gpuos_linear_fast(const GpuosTask* t, const GpuosLinearPlan& p) {
  const GpuosTensorRef &x = t->in[0], &w = t->in[1];
  const bool half = x.dtype == GPUOS_DTYPE_F16 || x.dtype == GPUOS_DTYPE_BF16;
  const bool rows = p.xrs >= 0 && p.xrs % 8 == 0 && p.ors >= 0 && w.strides[0] % 8 == 0;
  const bool unit = x.strides[x.ndim - 1] == 1 && w.strides[1] == 1;
  const bool aligned = p.k % 8 == 0 && gpuos_aligned16(x.data) && gpuos_aligned16(w.data);
  const bool wide = !p.wide || (GPUOS_WGMMA && p.n % 2 == 0 && gpuos_linear_pairs(t->out, p.ors));
  return GPUOS_SM80 && wide && half && x.dtype == w.dtype && rows && unit && aligned && p.k > 0 &&
         blockDim.x >= GPUOS_LINEAR_MMA_THREADS && gpuos_dynamic_smem_bytes() >= GPUOS_LINEAR_SMEM;
}

__device__ __forceinline__ GpuosLinearPlan gpuos_linear_plan(const GpuosTask* t, bool parts) {
  const GpuosTensorRef &x = t->in[0], &ws = t->in[3];
  GpuosLinearPlan p;
  p.m = static_cast<int>(gpuos_numel_dims(x, (1u << gpuos_row_dims(x)) - 1u));
  p.n = static_cast<int>(t->in[1].sizes[0]);
  p.k = static_cast<int>(gpuos_row_len(x));
  p.wide = ws.ndim == (parts ? 3 : 2);
  p.bm = p.wide ? GPUOS_LINEAR_WIDE : GPUOS_LINEAR_BM;
  p.bn = p.wide ? GPUOS_LINEAR_WIDE : GPUOS_LINEAR_BN;
  p.mblocks = (p.m + p.bm - 1) / p.bm;
  p.ntiles = (p.n + p.bn - 1) / p.bn;
  p.prows = (min(p.m, p.bm) + GPUOS_LINEAR_PART_ROWS - 1) & -GPUOS_LINEAR_PART_ROWS;
  p.parts = parts;
  if (parts) {
    p.splits = static_cast<int>(t->out.sizes[0]);
  } else if (ws.numel == 0) {
    p.splits = 1;
  } else {
    const unsigned tiles = p.mblocks * p.ntiles, block = tiles * p.prows * p.bn;
    const unsigned partials = static_cast<unsigned>(ws.numel) - gpuos_linear_counters(tiles);
    p.splits = static_cast<int>(partials / block);
  }
  const int steps = (p.k + GPUOS_LINEAR_KSTEP - 1) / GPUOS_LINEAR_KSTEP;
  const int per_split = (steps + p.splits - 1) / p.splits;
  p.kch = (per_split + GPUOS_LINEAR_STEP_ALIGN - 1) & -GPUOS_LINEAR_STEP_ALIGN;
  p.xrs = gpuos_linear_row_stride(x);
  p.ors = gpuos_linear_row_stride(t->out);
  p.fast = gpuos_linear_fast(t, p);
  return p;
}

__device__ __forceinline__ GpuosLinearItem gpuos_linear_item(const GpuosLinearPlan& p, int i) {
  const unsigned u = static_cast<unsigned>(i), mb = u % p.mblocks, rest = u / p.mblocks;
  GpuosLinearItem it;
  it.mb = mb;
  it.s = rest % p.splits;
  it.nt = rest / p.splits;
  it.rows = min(p.bm, p.m - p.bm * it.mb);
  it.k0 = it.s * p.kch * GPUOS_LINEAR_KSTEP;
  it.k1 = min(p.k, it.k0 + p.kch * GPUOS_LINEAR_KSTEP);
  const int k = it.k1 - it.k0;
  const int steps = k > 0 ? (k + GPUOS_LINEAR_KSTEP - 1) / GPUOS_LINEAR_KSTEP : 0;
  it.steps = (steps + GPUOS_LINEAR_STEP_ALIGN - 1) & -GPUOS_LINEAR_STEP_ALIGN;
  return it;
}

/* Whether the item adds the bias: to the whole sum (K unsplit) or to split 0's part. */
__device__ __forceinline__ bool gpuos_linear_biased(const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it) {
  return p.parts ? it.s == 0 : p.splits == 1;
}

/* Whether the items' values go to partial blocks that the last split combines. */
__device__ __forceinline__ bool gpuos_linear_combined(const GpuosLinearPlan& p) {
  return !p.parts && p.splits > 1;
}

/* Row of out that row m of x takes in the item: parts mode stacks the splits' M rows. */
__device__ __forceinline__ int gpuos_linear_out_row(const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it, int m) {
  return p.parts ? it.s * p.m + m : m;
}

/* ---- outputs: final values and the split-K combine ------------------------------------------ */

/* Bias of output n: 0 without a bias or past the outputs. Callers load it ahead of the stores
 * that use it: a load behind a store waits for that store's issue (in order), so one load per
 * store made every store a round trip to L2. */
__device__ __forceinline__ float gpuos_linear_bias(const GpuosTask* t, const GpuosLinearPlan& p,
                                                   int n) {
  const GpuosTensorRef& b = t->in[2];
  return b.numel != 0 && n < p.n ? gpuos_load(b, n * b.strides[0]) : 0.0f;
}

/* out[m][n] = v (the bias already added), through out's dims (the CUDA-core path). */
__device__ __forceinline__ void gpuos_linear_final(const GpuosTask* t, int m, int n, float v) {
  gpuos_store(t->out, gpuos_row_offset(t->out, m, n), v);
}

/* The final values v0, v1 of outputs n, n + 1 (n even; the bias added), ACT applied, through
 * out's dims: stored as they are, or gated into output n / 2; those past the outputs left out. */
template <int ACT>
__device__ __forceinline__ void gpuos_linear_final2(const GpuosTask* t, const GpuosLinearPlan& p,
                                                    int m, int n, float v0, float v1) {
  if constexpr (ACT == GPUOS_LINEAR_SILU_GLU) {
    if (n < p.n) gpuos_linear_final(t, m, n / 2, gpuos_linear_silu(v0) * v1);
  } else {
    if (n < p.n) gpuos_linear_final(t, m, n, gpuos_linear_act<ACT>(v0));
    if (n + 1 < p.n) gpuos_linear_final(t, m, n + 1, gpuos_linear_act<ACT>(v1));
  }
}

/* out as the tensor-core path stores it (rows p.ors apart), in registers: a store through a
 * generic pointer may alias the descriptor and plan in shared memory, so each store would
 * otherwise reload them. `pair`: gpuos_linear_pairs. */
struct GpuosLinearSink {
  char* data;
  int64_t ors, cs; /* elements between rows and between outputs */
  int dtype, size; /* out's dtype and its bytes */
  int outputs;     /* N */
  bool pair;

  __device__ static GpuosLinearSink of(const GpuosTask* t, const GpuosLinearPlan& p) {
    const GpuosTensorRef& o = t->out;
    GpuosLinearSink k;
    k.data = gpuos_data(o);
    k.ors = p.ors;
    k.cs = o.strides[o.ndim - 1];
    k.dtype = o.dtype;
    k.size = gpuos_dtype_size(o.dtype);
    k.outputs = p.n;
    k.pair = gpuos_linear_pairs(o, p.ors);
    return k;
  }

  /* The final values v0, v1 of outputs n, n + 1 (n even; the bias added), ACT applied:
   * stored as they are, or gated into output n / 2. */
  template <int ACT>
  __device__ __forceinline__ void emit2(int m, int n, float v0, float v1) const {
    if constexpr (ACT == GPUOS_LINEAR_SILU_GLU) {
      if (n < outputs)
        gpuos_store_ptr(data + (m * ors + n / 2 * cs) * size, dtype, gpuos_linear_silu(v0) * v1);
    } else {
      store2(m, n, gpuos_linear_act<ACT>(v0), gpuos_linear_act<ACT>(v1));
    }
  }

  /* out[m][n] = v0 and out[m][n + 1] = v1 (n even), those past the outputs left out. */
  __device__ void store2(int m, int n, float v0, float v1) const {
    char* at = data + (m * ors + n * cs) * size;
    if (pair && n + 1 < outputs) {
      if (size == 4) {
        *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
      } else {
        *reinterpret_cast<unsigned int*>(at) = gpuos_f32x2_to_16(dtype, v0, v1);
      }
      return;
    }
    if (n < outputs) gpuos_store_ptr(at, dtype, v0);
    if (n + 1 < outputs) gpuos_store_ptr(at + cs * size, dtype, v1);
  }
};

/* Partial block of split s of tile (mb, nt): P rows of the tile's outputs in fp32, 16-byte
 * aligned. */
__device__ __forceinline__ float* gpuos_linear_part(const GpuosTask* t, const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it, int s) {
  const int64_t tiles = static_cast<int64_t>(p.mblocks) * p.ntiles;
  const int64_t block = (s * tiles + it.nt * p.mblocks + it.mb) * p.prows * p.bn;
  return reinterpret_cast<float*>(gpuos_data(t->in[3])) + gpuos_linear_counters(tiles) + block;
}

/* The tile's outputs from its S partial blocks, summed in split order, by all threads in groups
 * of 4 outputs (quads): a thread takes C quads at a time with U splits of each, all C U loads in
 * flight together and its quads' biases with them. UNIFORM: rows of out are p.ors apart (the
 * tensor-core path's condition), stored through a GpuosLinearSink; else through out's dims. BN:
 * the plan's outputs of a tile. */
template <int ACT, bool UNIFORM, int BN, int C, int U>
__device__ __forceinline__ void gpuos_linear_combine_quads(const GpuosTask* t,
                                                           const GpuosLinearPlan& p,
                                                           const GpuosLinearItem& it) {
  constexpr int QUADS = BN / 4; /* quad i: row i / QUADS, outputs 4 (i % QUADS) on */
  const int64_t plane = static_cast<int64_t>(p.mblocks) * p.ntiles * p.prows * BN;
  const float4* first = reinterpret_cast<const float4*>(gpuos_linear_part(t, p, it, 0));
  const int quads = it.rows * QUADS;
  const GpuosLinearSink sink = GpuosLinearSink::of(t, p); /* UNIFORM's stores */
  GPUOS_ROLLED
  for (int i0 = threadIdx.x; i0 < quads; i0 += C * blockDim.x) {
    int quad[C], n[C]; /* this thread's quads this round (past the last: quad i0 again), outputs */
    float bias[C][4];
    float4 sum[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int i = i0 + c * blockDim.x;
      quad[c] = i < quads ? i : i0;
      n[c] = i < quads ? BN * it.nt + 4 * (i % QUADS) : p.n; /* p.n: none stored */
#pragma unroll
      for (int e = 0; e < 4; ++e) bias[c][e] = gpuos_linear_bias(t, p, n[c] + e);
      sum[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    GPUOS_ROLLED
    for (int s0 = 0; s0 < p.splits; s0 += U) {
      float4 v[C][U];
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int u = 0; u < U; ++u) /* past the splits: split s0 again */
          v[c][u] = __ldcg(first + (s0 + u < p.splits ? s0 + u : s0) * plane / 4 + quad[c]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (s0 + u >= p.splits) continue;
          sum[c].x += v[c][u].x, sum[c].y += v[c][u].y;
          sum[c].z += v[c][u].z, sum[c].w += v[c][u].w;
        }
      }
    }
    if (i0 == threadIdx.x) GPUOS_MARK(7); /* thread 0's first quads summed */
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int m = p.bm * it.mb + quad[c] / QUADS;
      const float v[4] = {sum[c].x + bias[c][0], sum[c].y + bias[c][1], sum[c].z + bias[c][2],
                          sum[c].w + bias[c][3]};
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        if constexpr (UNIFORM) {
          sink.template emit2<ACT>(m, n[c] + e, v[e], v[e + 1]);
        } else {
          gpuos_linear_final2<ACT>(t, p, m, n[c] + e, v[e], v[e + 1]);
        }
      }
    }
  }
}

/* The combine, 8 splits of a quad in flight where a thread has at most one quad, else 4 splits
 * of 2 quads (at 64 rows, 4 quads a thread: two rounds of loads instead of four). WIDE: an
 * m-block may have more quads than the block threads (more than 16 rows); else the one-quad
 * version alone is compiled, which spares the small-M paths its registers. BN: the plan's
 * outputs of a tile. */
template <int ACT, bool UNIFORM, bool WIDE, int BN>
__device__ __forceinline__ void gpuos_linear_combine(const GpuosTask* t, const GpuosLinearPlan& p,
                                                     const GpuosLinearItem& it) {
  if (WIDE && it.rows * (BN / 4) > static_cast<int>(blockDim.x)) {
    gpuos_linear_combine_quads<ACT, UNIFORM, BN, 2, 4>(t, p, it);
  } else {
    gpuos_linear_combine_quads<ACT, UNIFORM, BN, 1, 8>(t, p, it);
  }
}

/* After every thread emitted the item's values: with K split, count this split in and, in the
 * block that completes the tile, combine it. All threads call; `last` is shared scratch (read
 * here before any thread can pass the next call's first barrier, where it is rewritten). WIDE and
 * BN as in gpuos_linear_combine. */
template <int ACT, bool UNIFORM, bool WIDE, int BN>
__device__ __forceinline__ void gpuos_linear_arrive(const GpuosTask* t, const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it, int* last) {
  if (!gpuos_linear_combined(p)) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* counters = reinterpret_cast<unsigned int*>(gpuos_data(t->in[3]));
    *last = gpuos_count_in(counters + it.nt * p.mblocks + it.mb, p.splits - 1);
  }
  __syncthreads();
  GPUOS_MARK(4);
  if (*last) {
    gpuos_linear_combine<ACT, UNIFORM, WIDE, BN>(t, p, it);
    GPUOS_MARK(5);
  }
}

/* ---- the CUDA-core path --------------------------------------------------------------------- */

/* A thread sums two neighbouring outputs n, n + 1 (n even) of a row at a time, so that a gated
 * operator's pair meets in one thread; an output past N sums nothing. */
template <int ACT>
__device__ __forceinline__ void gpuos_linear_cuda_cores(const GpuosTask* t,
                                                        const GpuosLinearPlan& p, int* last) {
  const GpuosTensorRef &x = t->in[0], &w = t->in[1];
  const int pairs = p.bn / 2;
  GPUOS_ROLLED
  for (int64_t i = t->range_begin; i < t->range_end; ++i) {
    const GpuosLinearItem it = gpuos_linear_item(p, static_cast<int>(i));
    GPUOS_ROLLED
    for (int o = threadIdx.x; o < it.rows * pairs; o += blockDim.x) {
      const int r = o / pairs, c = 2 * (o % pairs), n = p.bn * it.nt + c;
      if (n >= p.n) continue;
      const char* xp = gpuos_ptr(x, gpuos_row_offset(x, p.bm * it.mb + r, it.k0));
      const int64_t xstep = gpuos_step(x, x.ndim - 1), wstep = gpuos_step(w, 1);
      float sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (n + e >= p.n) continue;
        const char* xk = xp;
        const char* wp = gpuos_ptr(w, (n + e) * w.strides[0] + it.k0 * w.strides[1]);
        GPUOS_ROLLED
        for (int k = it.k0; k < it.k1; ++k, xk += xstep, wp += wstep)
          sum[e] += gpuos_load_ptr(xk, x.dtype) * gpuos_load_ptr(wp, w.dtype);
      }
      if (gpuos_linear_combined(p)) {
        float* part = gpuos_linear_part(t, p, it, it.s) + r * p.bn + c;
        part[0] = sum[0], part[1] = sum[1];
      } else {
        const bool biased = gpuos_linear_biased(p, it);
        const int m = gpuos_linear_out_row(p, it, p.bm * it.mb + r);
        gpuos_linear_final2<ACT>(t, p, m, n, sum[0] + (biased ? gpuos_linear_bias(t, p, n) : 0.0f),
                                 sum[1] + (biased ? gpuos_linear_bias(t, p, n + 1) : 0.0f));
      }
    }
    if (p.wide) {
      gpuos_linear_arrive<ACT, false, true, GPUOS_LINEAR_WIDE>(t, p, it, last);
    } else {
      gpuos_linear_arrive<ACT, false, true, GPUOS_LINEAR_BN>(t, p, it, last);
    }
  }
}

/* ---- the tensor-core path ------------------------------------------------------------------- */

__device__ __forceinline__ unsigned int gpuos_smem_address(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

/* An L2 policy for data a step reads once (the weights): its lines are evicted first, so that
 * streaming them does not push out what the step reads again (its activations, the KV cache,
 * the code of operators that run once a step). */
__device__ __forceinline__ unsigned long long gpuos_l2_evict_first() {
  unsigned long long policy = 0;
#if GPUOS_SM80
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

/* 16 bytes into shared memory, from global memory through L2 only; `bytes` 0 writes zeros.
 * STREAM: with the L2 policy `policy` (gpuos_l2_evict_first). */
template <bool STREAM>
__device__ __forceinline__ void gpuos_cp_async16(unsigned int dst, const void* src, int bytes,
                                                 unsigned long long policy) {
#if GPUOS_SM80
  /* no "memory" clobber: it would make every field read from shared memory (descriptor, plan)
   * after it a fresh load; the commit and the wait, volatile and ordered with it, carry one */
  if constexpr (STREAM) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                 ::"r"(dst), "l"(src), "r"(bytes), "l"(policy));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
  }
#else
  __trap();
#endif
}

__device__ __forceinline__ void gpuos_cp_async_commit() {
#if GPUOS_SM80
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void gpuos_cp_async_wait() {
#if GPUOS_SM80
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

/* d += a b for one m16n8k16 tile, fp32 accumulators. */
template <bool BF16>
__device__ __forceinline__ void gpuos_mma16816(float (&d)[4], unsigned int a0, unsigned int a1,
                                               unsigned int a2, unsigned int a3, unsigned int b0,
                                               unsigned int b1) {
#if !GPUOS_SM80
  __trap();
#else
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

/* 16 bytes of shared memory at 32-bit shared address `a`. */
__device__ __forceinline__ uint4 gpuos_lds16(unsigned int a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}

/* ---- warpgroup products (GPUOS_WGMMA: sm_90a) ---------------------------------------------- */

/* The shared-memory descriptor of a K-major operand in the swizzle of its rows of PITCH bytes,
 * 128 or 64 (64 or 32 16-bit elements of k): 16-byte chunk c of row r at chunk c ^ (r % 8) in
 * the 128-byte swizzle, c ^ (r / 2 % 4) in the 64-byte one; 8-row groups 8 PITCH bytes apart
 * from a 1,024-byte aligned base. `a` may sit 32, 64 or 96 bytes into the row (the k16 slices of
 * a stage), the hardware swizzling by address. */
template <int PITCH>
__device__ __forceinline__ unsigned long long gpuos_wgmma_desc(unsigned int a) {
  static_assert(PITCH == 128 || PITCH == 64, "the 128- and 64-byte swizzles");
  constexpr unsigned long long mode = PITCH == 128 ? 1 : 2, groups = 8 * PITCH / 16;
  return ((a & 0x3FFFFu) >> 4) | (1ull << 16) | (groups << 32) | (mode << 62);
}

/* Pins the accumulators around the asynchronous products: no move of them may cross. */
template <int A>
__device__ __forceinline__ void gpuos_wgmma_pin(float (&d)[A]) {
#pragma unroll
  for (int e = 0; e < A; ++e) asm volatile("" : "+f"(d[e]));
}

/* The products' asm (gpuos_wgmma), m64n32k16 and m64n128k16; their tail: scale-d p (set: d
 * accumulates), A and B unscaled and K-major. */
#define GPUOS_WGMMA_SCALE_D "p, 1, 1, 0, 0;\n}\n"
#define GPUOS_WGMMA_N32(TYPE)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                     \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "          \
               "%16, %17, " GPUOS_WGMMA_SCALE_D                                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),           \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),         \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                                \
               : "l"(a), "l"(b), "r"(1))
#define GPUOS_WGMMA_N128(TYPE)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                        \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                   \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "            \
               "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "            \
               "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "            \
               "%58, %59, %60, %61, %62, %63}, %64, %65, " GPUOS_WGMMA_SCALE_D                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),           \
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),         \
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),     \
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),     \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),     \
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),     \
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),     \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),     \
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),     \
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),     \
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                \
               : "l"(a), "l"(b), "r"(1))

/* d += A[64 x 16] B[16 x N], A and B K-major in shared memory (gpuos_wgmma_desc): a warpgroup's
 * product of N = 2 A outputs (32 or 128), fp32 accumulators in the layout of N / 8 m16n8 tiles
 * per warp (warp w of the group rows 16 w .., d[4 j + 2 h + e] row g + 8 h, column
 * 8 j + 2 q + e). */
template <bool BF16, int A>
__device__ __forceinline__ void gpuos_wgmma(float (&d)[A], unsigned long long a,
                                            unsigned long long b) {
  static_assert(A == 16 || A == 64, "m64n32 and m64n128 products");
#if GPUOS_WGMMA
  if constexpr (A == 16 && BF16) {
    GPUOS_WGMMA_N32("bf16");
  } else if constexpr (A == 16) {
    GPUOS_WGMMA_N32("f16");
  } else if constexpr (BF16) {
    GPUOS_WGMMA_N128("bf16");
  } else {
    GPUOS_WGMMA_N128("f16");
  }
#else
  __trap();
#endif
}
#undef GPUOS_WGMMA_N32
#undef GPUOS_WGMMA_N128
#undef GPUOS_WGMMA_SCALE_D

/* The stage's products of one warpgroup over the stage's PITCH / 2 k: 64 rows of x (at shared
 * address x) times A / 2 rows of W (at w), 32 (a 64-row tile's half) or 128 (a wide tile's),
 * into its A accumulators. `meanwhile()` runs while the tensor cores compute them (the next
 * copies' issue, which stalls while the copy queue is full), then they are waited for. */
template <bool BF16, int PITCH, int A, class F>
__device__ __forceinline__ void gpuos_wgmma_stage(float (&d)[A], unsigned int w, unsigned int x,
                                                  F&& meanwhile) {
#if GPUOS_WGMMA
  /* no "memory" clobbers (they would make every field read from shared memory after them a fresh
   * load): the barrier before and the volatile copies after keep the products between */
  const unsigned long long a = gpuos_wgmma_desc<PITCH>(x), b = gpuos_wgmma_desc<PITCH>(w);
  gpuos_wgmma_pin(d);
  asm volatile("wgmma.fence.sync.aligned;");
#pragma unroll
  for (int kk = 0; kk < PITCH / 32; ++kk) /* k16 slice kk: 32 bytes on, 2 in the address field */
    gpuos_wgmma<BF16>(d, a + 2 * kk, b + 2 * kk);
  asm volatile("wgmma.commit_group.sync.aligned;");
  meanwhile();
  asm volatile("wgmma.wait_group.sync.aligned 0;");
  gpuos_wgmma_pin(d);
#else
  __trap();
#endif
}

/* After this thread's copies into shared memory landed: make them visible to the warpgroup
 * products, which read shared memory through the async proxy. */
__device__ __forceinline__ void gpuos_fence_async_shared() {
#if GPUOS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

/* The pipeline of the tensor-core path, in gpuos_dynamic_smem: NS stages, each STEPS steps of
 * the current item, W's rows of the n-tile then R rows of x (R: rows of an m-block rounded up to
 * 8, 16, 32 or 64; 128 for a wide plan's tiles). 16-byte chunk c of row r of either sits at chunk
 * c ^ 4 (r & 1), so that the 8 lanes of each quarter warp (rows g, g + 1, chunks q .. q + 3 of
 * one step) hit 8 different bank groups. W then has NS - 1 stages in flight (24 to 48 KB), where a
 * ring in registers held 16 KB. 72 KB of shared memory measured as fast as 96 KB and leaves room
 * for a second worker block per SM. */
template <int R>
struct GpuosLinearPipe {
  /* 64-row m-blocks and wide tiles on warpgroup products (GPUOS_WGMMA): rows in the swizzle
   * their descriptors name (gpuos_wgmma_desc), stages 1,024-byte aligned; a wide tile's stages
   * one step (64-byte rows), so that four of them fit */
  static constexpr bool WG = GPUOS_WGMMA && R >= 64;
  static constexpr bool WIDE = R > GPUOS_LINEAR_BM;
  static constexpr int BM = WIDE ? GPUOS_LINEAR_WIDE : GPUOS_LINEAR_BM; /* rows of an m-block */
  static constexpr int BN = WIDE ? GPUOS_LINEAR_WIDE : GPUOS_LINEAR_BN; /* outputs of an n-tile */
  static constexpr int STEPS = WIDE ? 1 : R >= 64 ? 2 : 4;  /* steps a stage covers */
  static constexpr int KC = STEPS * GPUOS_LINEAR_KSTEP;    /* elements of a row of a stage */
  static constexpr int PITCH = 2 * KC;                      /* bytes of a row */
  static constexpr int CHUNKS = KC / 8;                     /* 16-byte chunks of a row */
  static constexpr int W_BYTES = BN * PITCH;
  static constexpr int BYTES = W_BYTES + R * PITCH;
  /* of the first stage: 1,024 for the swizzle atoms; 128 below 64 rows, because where in a
   * 128-byte line the stages start changes the k loop's speed by ~6% (bench/NOTES.md, s124-s126)
   * and the base follows the other operators' static shared memory */
  static constexpr int ALIGN = WG ? 1024 : 128;
  static constexpr int ROOM = GPUOS_LINEAR_SMEM - (ALIGN - 16); /* past the worst alignment */
  static constexpr int NS = ROOM / BYTES < 6 ? ROOM / BYTES : 6;
  static_assert((WG || CHUNKS >= 8) && NS >= 3, "the swizzle needs 128-byte rows; the wait, 3");
  static_assert(GPUOS_LINEAR_STEP_ALIGN % STEPS == 0, "items have whole stages");
  static_assert(!WG || BYTES % 1024 == 0, "whole swizzle atoms");
  static_assert(WG || !WIDE, "wide tiles on warpgroup products only");
  __device__ static int offset(int r, int chunk) {
    const int swizzle = !WG ? (r & 1 ? 4 : 0) : PITCH == 128 ? r & 7 : r >> 1 & 3;
    return r * PITCH + 16 * (chunk ^ swizzle);
  }
  /* The first stage's shared address, from the dynamic shared memory's. */
  __device__ static unsigned int first(unsigned int smem) {
    return (smem + ALIGN - 1) & ~(ALIGN - 1u);
  }
};

/* Where stage n of a record reads, the same in every thread (each keeps its own copy and moves it
 * on stage by stage: no shared state, no barrier). */
struct GpuosLinearStage {
  int item;     /* its item (range_end and past: none, rows and wrows are 0) */
  int k, k1;    /* first element of the stage; end of the item's k range */
  int left;     /* stages of the item from this one on */
  int row0;     /* first row of x of the item's m-block ... */
  int rows;     /* ... and its rows */
  int n0;       /* first row of W of the item's n-tile ... */
  int wrows;    /* ... and its rows */

  __device__ static GpuosLinearStage at(const GpuosTask* t, const GpuosLinearPlan& p, int i, int kc) {
    const GpuosLinearItem it = gpuos_linear_item(p, i);
    const bool in = i < t->range_end;
    GpuosLinearStage s;
    s.item = i;
    s.k = it.k0;
    s.k1 = it.k1;
    s.left = it.steps * GPUOS_LINEAR_KSTEP / kc;
    s.row0 = p.bm * it.mb;
    s.rows = in ? it.rows : 0;
    s.n0 = p.bn * it.nt;
    s.wrows = in ? min(p.bn, p.n - s.n0) : 0;
    return s;
  }

  __device__ void next(const GpuosTask* t, const GpuosLinearPlan& p, int kc) {
    k += kc;
    if (--left == 0) *this = at(t, p, item + 1, kc);
  }
};

/* Where a record's copies read, in registers (the descriptor and plan sit in shared memory). */
struct GpuosLinearSource {
  const char* w;  /* W */
  int64_t ws;     /* elements between rows of W */
  const char* x;  /* x */
  int64_t xrs;    /* elements between rows of x */
  int end;        /* the record's range_end */
};

/* Copy `rows` rows of a stage from `src` (rows `stride` elements apart, the stage's elements from
 * s.k on) into shared address `dst`, zeros past the item's k range and for rows [rows, COUNT):
 * pad steps and absent rows then add nothing. Each of the GPUOS_LINEAR_MMA_THREADS threads
 * copies one 16-byte column of the stage in rows STEP apart (an even step: the rows' parity, and
 * so their swizzle, stays), with pointers advanced rather than recomputed. */
template <int R, int COUNT, bool STREAM>
__device__ __forceinline__ void gpuos_linear_copy(unsigned int dst, const char* src, int64_t stride,
                                                  int rows, const GpuosLinearStage& s) {
  using Pipe = GpuosLinearPipe<R>;
  constexpr int STEP = GPUOS_LINEAR_MMA_THREADS / Pipe::CHUNKS;
  static_assert(STEP % 8 == 0, "rows STEP apart share their swizzle");
  const int col = threadIdx.x % Pipe::CHUNKS, row0 = threadIdx.x / Pipe::CHUNKS;
  const int kofs = s.k + 8 * col;
  const bool kin = kofs < s.k1;
  const char* from = src + 2 * (row0 * stride + kofs);
  const unsigned int to = dst + Pipe::offset(row0, col);
  const unsigned long long policy = STREAM ? gpuos_l2_evict_first() : 0ull;
#pragma unroll
  for (int i = 0; i * STEP < COUNT; ++i) {
    const int row = row0 + i * STEP;
    const bool in = kin && row < rows;
    if (row < COUNT)
      gpuos_cp_async16<STREAM>(to + i * STEP * Pipe::PITCH, in ? from : src, in ? 16 : 0, policy);
    from += 2 * STEP * stride;
  }
}

/* Stage s's W (wanted) and x (wanted) into buffer `buffer`, by the first
 * GPUOS_LINEAR_MMA_THREADS threads; no copies for a stage past the record's last item. The
 * caller commits. */
template <int R>
__device__ __forceinline__ void gpuos_linear_issue(const GpuosLinearSource& src,
                                                   unsigned int buffer, const GpuosLinearStage& s,
                                                   bool w, bool x) {
  using Pipe = GpuosLinearPipe<R>;
  if (s.item >= src.end || threadIdx.x >= GPUOS_LINEAR_MMA_THREADS) return;
  if (w) {
    const char* w0 = src.w + 2 * s.n0 * src.ws;
    /* a wide plan's W tile is read by each of its m-blocks: not streamed */
    gpuos_linear_copy<R, Pipe::BN, !Pipe::WIDE>(buffer, w0, src.ws, s.wrows, s);
  }
  if (x) {
    const char* x0 = src.x + 2 * s.row0 * src.xrs;
    gpuos_linear_copy<R, R, false>(buffer + Pipe::W_BYTES, x0, src.xrs, s.rows, s);
  }
}

/* A tensor-core lane's bias values (fp16 or bf16): bias[f] = outputs n0 + 8 f and n0 + 8 f + 1
 * (n0 even), zeros where the item adds none (biased) or past N. Every load is issued before any
 * is converted, so that they are all in flight together: behind gpuos_linear_bias's branches
 * each waited for the one before, and a wide tile's 32 took ~8 us before its first stage (a
 * 512-row GPT-2 QKV projection, H200, s248). */
template <bool BF16, int NW>
__device__ __forceinline__ void gpuos_linear_bias_pairs(const GpuosTask* t,
                                                        const GpuosLinearPlan& p, bool biased,
                                                        int n0, float (&bias)[NW][2]) {
  const GpuosTensorRef& b = t->in[2];
  const bool on = biased && b.numel != 0;
  const char* data = gpuos_data(b);
  const int64_t step = 2 * b.strides[0]; /* bytes between elements */
  unsigned short bits[NW][2];
#pragma unroll
  for (int f = 0; f < NW; ++f) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = n0 + 8 * f + e;
      bits[f][e] = gpuos_ld_u16_if(on && n < p.n, data + n * step);
    }
  }
#pragma unroll
  for (int f = 0; f < NW; ++f) {
#pragma unroll
    for (int e = 0; e < 2; ++e)
      bias[f][e] = gpuos_16_to_f32<BF16>(bits[f][e]);
  }
}

/* One lane's values of a wide tile (warpgroup products: acc[f][2 h + e] is row r + 8 h of the
 * m-block, output c + 8 f + e of the n-tile, c even) into the split's partial block (`part`) or
 * out, ACT applied: each row's stores at one address plus constant offsets, so that little
 * beyond the 64 values is live (their registers leave few). Out takes pairs and N is even (the
 * tensor-core path's condition for wide tiles). */
template <int ACT, int NW>
__device__ __forceinline__ void gpuos_linear_wide_out(const float (&acc)[NW][4], float* part,
                                                      const GpuosLinearSink& sink,
                                                      const GpuosLinearPlan& p,
                                                      const GpuosLinearItem& it, int r, int c) {
  constexpr bool GATED = ACT == GPUOS_LINEAR_SILU_GLU;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r + 8 * h;
    if (row >= it.rows) continue;
    const auto value = [&](int f, int e) { return acc[f][2 * h + e]; };
    if (part != nullptr) {
      float* at = part + row * GPUOS_LINEAR_WIDE + c;
#pragma unroll
      for (int f = 0; f < NW; ++f)
        *reinterpret_cast<float2*>(at + 8 * f) = make_float2(value(f, 0), value(f, 1));
      continue;
    }
    const int m = gpuos_linear_out_row(p, it, GPUOS_LINEAR_WIDE * it.mb + row);
    const int n = GPUOS_LINEAR_WIDE * it.nt + c, left = sink.outputs - n; /* f < left / 8 in */
    char* at = sink.data + (m * sink.ors + (GATED ? n / 2 : n)) * sink.size;
    /* each value computed whatever `left`, only its store guarded: a guard around the
     * computation made every pair a branch of its own */
    if (sink.size == 2) {
#pragma unroll
      for (int f = 0; f < NW; ++f) {
        if constexpr (GATED) {
          const float v = gpuos_linear_silu(value(f, 0)) * value(f, 1);
          const unsigned short out = gpuos_f32_to_16(sink.dtype, v);
          if (8 * f < left) *reinterpret_cast<unsigned short*>(at + 8 * f) = out;
        } else {
          const float v0 = gpuos_linear_act<ACT>(value(f, 0));
          const float v1 = gpuos_linear_act<ACT>(value(f, 1));
          const unsigned int out = gpuos_f32x2_to_16(sink.dtype, v0, v1);
          if (8 * f < left) *reinterpret_cast<unsigned int*>(at + 16 * f) = out;
        }
      }
    } else {
#pragma unroll
      for (int f = 0; f < NW; ++f) {
        if constexpr (GATED) {
          const float v = gpuos_linear_silu(value(f, 0)) * value(f, 1);
          if (8 * f < left) *reinterpret_cast<float*>(at + 16 * f) = v;
        } else {
          const float2 v =
              make_float2(gpuos_linear_act<ACT>(value(f, 0)), gpuos_linear_act<ACT>(value(f, 1)));
          if (8 * f < left) *reinterpret_cast<float2*>(at + 32 * f) = v;
        }
      }
    }
  }
}

/* The items of the record on tensor cores. W's first NS - 1 stages are issued before the wait
 * for x where W is settled (gpuos_settled: no producer in the program writes it), so a record
 * whose weights fit in them has them in shared memory when x is ready. Warps past
 * GPUOS_LINEAR_WARPS (blocks over 256 threads) keep the barriers, nothing else. */
template <int ACT, int R, bool BF16>
__device__ __forceinline__ void gpuos_linear_mma(const GpuosTask* t, const GpuosLinearPlan& p,
                                                 int* last) {
  using Pipe = GpuosLinearPipe<R>;
  /* The warps over the tile: WM along its rows of x, WN along its outputs. At 64 rows a 2 x 4
   * grid, each warp 32 rows x 16 outputs: 6 shared loads for 8 products a step, where 8 warps
   * over the outputs alone read all 64 rows each (9 loads for 8). On warpgroup products (WG) a
   * 4 x 2 grid: warpgroup wn takes outputs 32 wn .., its warp wm rows 16 wm .. of x; on a wide
   * tile 8 x 1: warpgroup g takes rows 64 g .. and all 128 outputs, its warps 16 rows each. */
  constexpr bool WG = Pipe::WG, WIDE = Pipe::WIDE;
  constexpr int WM = WIDE ? 8 : WG ? 4 : R >= 64 ? 2 : 1, WN = GPUOS_LINEAR_WARPS / WM;
  constexpr int TM = WG ? 1 : (R < 16 ? 1 : R / 16) / WM; /* m16 tiles of x a warp takes */
  constexpr int NW = Pipe::BN / 8 / WN;                  /* n8 fragments of W a warp takes */
  constexpr int NS = Pipe::NS, KC = Pipe::KC;
  static_assert(!WG || TM * NW * 4 == (WIDE ? 64 : 16), "a warpgroup product's accumulators");
  const int warp = threadIdx.x / GPUOS_WARP, lane = threadIdx.x % GPUOS_WARP;
  const int g = lane >> 2, q = lane & 3;
  const int wm = WG ? warp % WM : warp / WN, wn = WG ? warp / WM : warp % WN;
  const int wrow = 8 * NW * wn + g, xrow = 16 * TM * wm + g; /* this lane's first rows */
  const bool active = warp < GPUOS_LINEAR_WARPS;
  const int begin = static_cast<int>(t->range_begin), end = static_cast<int>(t->range_end);
  const unsigned int base = Pipe::first(gpuos_smem_address(gpuos_dynamic_smem));
  const GpuosLinearSource src = {gpuos_data(t->in[1]), t->in[1].strides[0],
                                 gpuos_data(t->in[0]), p.xrs, end};

  /* Stages 0 .. NS - 2, each one commit group: W before the wait when settled, x after it. */
  const bool early = gpuos_settled(t, 1);
  GpuosLinearStage fill = GpuosLinearStage::at(t, p, begin, KC);
  if (early) {
#pragma unroll
    for (int s = 0; s < NS - 1; ++s, fill.next(t, p, KC)) {
      gpuos_linear_issue<R>(src, base + s * Pipe::BYTES, fill, true, false);
      gpuos_cp_async_commit();
    }
    fill = GpuosLinearStage::at(t, p, begin, KC);
  }
  GPUOS_MARK(6);
  gpuos_await(t);
#pragma unroll
  for (int s = 0; s < NS - 1; ++s, fill.next(t, p, KC)) {
    gpuos_linear_issue<R>(src, base + s * Pipe::BYTES, fill, !early, true);
    gpuos_cp_async_commit();
  }

  /* This lane's 16 bytes in a stage: W rows wrow (+ 8 f) and x rows xrow (+ 8, + 16 a), chunk
   * 4 js + q at step js (the swizzle flips chunk bit 2, which the parity of js sets: 64 js past
   * one of two base offsets; rows 8 apart share their parity). */
  const unsigned int weven = Pipe::offset(wrow, q), wodd = Pipe::offset(wrow, 4 + q) - 64;
  const unsigned int xeven = Pipe::W_BYTES + Pipe::offset(xrow, q);
  const unsigned int xodd = Pipe::W_BYTES + Pipe::offset(xrow, 4 + q) - 64;
  int consume = 0; /* buffer read next */
  GPUOS_ROLLED
  for (int i = begin; i < end; ++i) {
    const GpuosLinearItem it = gpuos_linear_item(p, i);
    float bias[NW][2]; /* of this lane's outputs, where the item adds it */
    const auto load_bias = [&]() {
      const int n0 = Pipe::BN * it.nt + 8 * NW * wn + 2 * q;
      gpuos_linear_bias_pairs<BF16>(t, p, gpuos_linear_biased(p, it), n0, bias);
    };
    /* odd: below 64 rows, each step's second k16 half goes to its own accumulators, so that a
     * stage's products are two chains of STEPS dependent products, not one of 2 STEPS; summed
     * into acc once at the end (on warpgroup products it is never used) */
    float acc[TM][NW][4], odd[TM][NW][4];
#pragma unroll
    for (int a = 0; a < TM; ++a) {
#pragma unroll
      for (int f = 0; f < NW; ++f) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a][f][e] = odd[a][f][e] = 0.0f;
      }
    }
    if constexpr (WIDE) { /* the bias summed from the start: no registers of its own at the end */
      load_bias();
#pragma unroll
      for (int f = 0; f < NW; ++f) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][f][e] = bias[f][e & 1];
      }
    }
    /* The next stage in: this stage's group is in (at most the NS - 2 younger ones pending).
     * Returns the stage's shared address. */
    const auto arrive = [&](bool first) {
      gpuos_cp_async_wait<NS - 2>();
      if constexpr (WG) gpuos_fence_async_shared();
      __syncthreads();
      if (i == begin && first) GPUOS_MARK(2); /* the record's first stage is in */
      return base + consume * Pipe::BYTES;
    };
    /* After arrive: every thread is done with the buffer read before this stage, which takes
     * stage n + NS - 1; then on to the next stage. */
    const auto refill = [&]() {
      const int buffer = consume == 0 ? NS - 1 : consume - 1;
      gpuos_linear_issue<R>(src, base + buffer * Pipe::BYTES, fill, true, true);
      gpuos_cp_async_commit();
      fill.next(t, p, KC);
      consume = consume == NS - 1 ? 0 : consume + 1;
    };
    if constexpr (WG) {
      /* the last stage apart: the bias (twice the outputs a lane) loaded with it, so that it
       * takes no registers through the k loop (an item has at least one stage); a wide tile's
       * is in its accumulators already */
      constexpr int A = TM * NW * 4;
      float(&d)[A] = reinterpret_cast<float(&)[A]>(acc);
      const int group = warp / 4; /* this warp's warpgroup: its rows of W, or of x when wide */
      const unsigned int wofs = WIDE ? 0 : 32 * group * Pipe::PITCH;
      const unsigned int xofs = Pipe::W_BYTES + (WIDE ? 64 * group * Pipe::PITCH : 0);
      const auto products = [&](unsigned int stage) {
        if (active) {
          gpuos_wgmma_stage<BF16, Pipe::PITCH>(d, stage + wofs, stage + xofs, refill);
        } else {
          refill();
        }
      };
      int j0 = 0;
      GPUOS_ROLLED
      for (; j0 + Pipe::STEPS < it.steps; j0 += Pipe::STEPS) products(arrive(j0 == 0));
      const unsigned int stage = arrive(j0 == 0);
      if constexpr (!WIDE) load_bias();
      products(stage);
    } else {
      load_bias(); /* ahead of the products */
      GPUOS_ROLLED
      for (int j0 = 0; j0 < it.steps; j0 += Pipe::STEPS) {
        const unsigned int stage = arrive(j0 == 0);
        refill();
        if (!active) continue;
#pragma unroll
        for (int js = 0; js < Pipe::STEPS; ++js) {
          const unsigned int at = stage + 64 * js;
          uint4 b[NW];
#pragma unroll
          for (int f = 0; f < NW; ++f)
            b[f] = gpuos_lds16(at + (js & 1 ? wodd : weven) + 8 * f * Pipe::PITCH);
          const unsigned int xl = at + (js & 1 ? xodd : xeven);
#pragma unroll
          for (int a = 0; a < TM; ++a) {
            const uint4 lo = gpuos_lds16(xl + 16 * a * Pipe::PITCH);
            const uint4 hi =
                R < 16 ? make_uint4(0, 0, 0, 0) : gpuos_lds16(xl + (16 * a + 8) * Pipe::PITCH);
#pragma unroll
            for (int f = 0; f < NW; ++f) {
              gpuos_mma16816<BF16>(acc[a][f], lo.x, hi.x, lo.y, hi.y, b[f].x, b[f].y);
              gpuos_mma16816<BF16>(odd[a][f], lo.z, hi.z, lo.w, hi.w, b[f].z, b[f].w);
            }
          }
        }
      }
#pragma unroll
      for (int a = 0; a < TM; ++a) {
#pragma unroll
        for (int f = 0; f < NW; ++f) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[a][f][e] += odd[a][f][e];
        }
      }
    }
    GPUOS_MARK(3);
    /* acc[a][f][2 h + e]: row 16 (TM wm + a) + g + 8 h of x, output 8 (NW wn + f) + 2 q + e: the
     * final values, or two neighbours of the split's partial block in one store (its columns
     * past N hold zeros, which the combine never reads) */
    float* part = gpuos_linear_combined(p) ? gpuos_linear_part(t, p, it, it.s) : nullptr;
    const GpuosLinearSink sink = GpuosLinearSink::of(t, p);
    if constexpr (WIDE) {
      if (active) gpuos_linear_wide_out<ACT, NW>(acc[0], part, sink, p, it, 16 * wm + g, 2 * q);
    } else {
#pragma unroll
      for (int a = 0; a < TM; ++a) {
#pragma unroll
        for (int f = 0; f < NW; ++f) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * (TM * wm + a) + g + 8 * h, c = 8 * (NW * wn + f) + 2 * q;
            const int m = Pipe::BM * it.mb + r, n = Pipe::BN * it.nt + c;
            const float v0 = acc[a][f][2 * h], v1 = acc[a][f][2 * h + 1];
            if (!active || r >= it.rows) continue;
            if (part != nullptr) {
              *reinterpret_cast<float2*>(part + r * Pipe::BN + c) = make_float2(v0, v1);
              continue;
            }
            const int row = gpuos_linear_out_row(p, it, m);
            sink.template emit2<ACT>(row, n, v0 + bias[f][0], v1 + bias[f][1]);
          }
        }
      }
    }
    GPUOS_MARK(1);
    gpuos_linear_arrive<ACT, true, (R > 16), Pipe::BN>(t, p, it, last);
  }
  gpuos_cp_async_wait<0>(); /* no copy may land in shared memory after the operator returned */
}

template <int ACT, int R>
__device__ __forceinline__ void gpuos_linear_mma_dtype(const GpuosTask* t, const GpuosLinearPlan& p,
                                                       int* last) {
  if (t->in[0].dtype == GPUOS_DTYPE_BF16) {
    gpuos_linear_mma<ACT, R, true>(t, p, last);
  } else {
    gpuos_linear_mma<ACT, R, false>(t, p, last);
  }
}

/* Says to the compiler what a path's arguments are: the record (gpuos_fetch), the plan and
 * `last` (gpuos_linear) all live in shared memory. Behind a call it cannot see that, and every
 * read of them was a generic load (sm_90a PTX: ld.shared 1,790 -> 121, generic ld 0 -> ~3,000),
 * as GPUOS_OPERATOR says of the record behind a generic pointer; said, the wide tiles at 512
 * rows ran 3-6% faster on the H200 (s246). */
__device__ __forceinline__ void gpuos_linear_in_shared(const GpuosTask* t, const GpuosLinearPlan& p,
                                                       const int* last) {
  __builtin_assume(__isShared(t));
  __builtin_assume(__isShared(&p));
  __builtin_assume(__isShared(last));
}

/* The paths of a plan, each a function of its own: the wide tiles' 64 accumulators a lane would
 * otherwise raise the register pressure of the decode rows' paths, and a call in their function
 * changes its register allocation too (spills 164 -> 192 bytes a thread, its 64-row linears
 * up to 10% slower on the H200, s241). `p` and `last` are the operator's shared memory. */
template <int ACT>
__device__ __noinline__ void gpuos_linear_narrow(const GpuosTask* t, const GpuosLinearPlan& p,
                                                 int* last) {
  gpuos_linear_in_shared(t, p, last);
  const int rows = min(p.m, GPUOS_LINEAR_BM);
  if (rows <= 8) {
    gpuos_linear_mma_dtype<ACT, 8>(t, p, last);
  } else if (rows <= 16) {
    gpuos_linear_mma_dtype<ACT, 16>(t, p, last);
  } else if (rows <= 32) {
    gpuos_linear_mma_dtype<ACT, 32>(t, p, last);
  } else {
    gpuos_linear_mma_dtype<ACT, 64>(t, p, last);
  }
}

template <int ACT>
__device__ __noinline__ void gpuos_linear_wide(const GpuosTask* t, const GpuosLinearPlan& p,
                                               int* last) {
  gpuos_linear_in_shared(t, p, last);
  gpuos_linear_mma_dtype<ACT, GPUOS_LINEAR_WIDE>(t, p, last);
}

template <int ACT>
__device__ __noinline__ void gpuos_linear_generic(const GpuosTask* t, const GpuosLinearPlan& p,
                                                  int* last) {
  gpuos_linear_in_shared(t, p, last);
  gpuos_await(t);
  gpuos_linear_cuda_cores<ACT>(t, p, last);
}

/* ACT: GPUOS_LINEAR_IDENTITY in parts mode (the parts are not final values). */
template <bool PARTS, int ACT>
__device__ __forceinline__ void gpuos_linear(const GpuosTask* t) {
  __shared__ GpuosLinearPlan plan;
  __shared__ int last;
  if (t->range_begin >= t->range_end) { /* no items (an empty x or W): uniform */
    gpuos_await(t);
    return;
  }
  /* GPUOS_TASK_EARLY: the plan (from the descriptor alone) and the weights, where settled,
   * before the wait for x */
  if (threadIdx.x == 0) plan = gpuos_linear_plan(t, PARTS);
  __syncthreads();
  GPUOS_MARK(0);
  if (!plan.fast) {
    gpuos_linear_generic<ACT>(t, plan, &last);
  } else if (plan.wide) {
    if constexpr (GPUOS_WGMMA) gpuos_linear_wide<ACT>(t, plan, &last);
  } else {
    gpuos_linear_narrow<ACT>(t, plan, &last);
  }
}

/* A catalogue operator of this header: PARTS and the activation ACT fixed per symbol. */
#define GPUOS_DEFINE_LINEAR_OP(SYMBOL, PARTS, ACT) \
  GPUOS_OPERATOR(SYMBOL) { gpuos_linear<PARTS, ACT>(t); }
#define GPUOS_DEFINE_LINEAR(SYMBOL) GPUOS_DEFINE_LINEAR_OP(SYMBOL, false, GPUOS_LINEAR_IDENTITY)
#define GPUOS_DEFINE_LINEAR_GELU(SYMBOL) GPUOS_DEFINE_LINEAR_OP(SYMBOL, false, GPUOS_LINEAR_GELU)
#define GPUOS_DEFINE_LINEAR_GELU_TANH(SYMBOL) \
  GPUOS_DEFINE_LINEAR_OP(SYMBOL, false, GPUOS_LINEAR_GELU_TANH)
#define GPUOS_DEFINE_LINEAR_SILU_GLU(SYMBOL) \
  GPUOS_DEFINE_LINEAR_OP(SYMBOL, false, GPUOS_LINEAR_SILU_GLU)
#define GPUOS_DEFINE_LINEAR_PARTS(SYMBOL) GPUOS_DEFINE_LINEAR_OP(SYMBOL, true, GPUOS_LINEAR_IDENTITY)
