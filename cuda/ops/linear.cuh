/* linear.cuh: out = x W^T (+ bias), the matmuls of a decode step, on tensor cores.
 *
 * Contract (host encoding: gpuos_core/families.py, LinearFamily and LinearPlan):
 *   in[0] = x [..., K]: M rows, numbered row-major over its leading dims;
 *   in[1] = W [N, K], Hugging Face's layout (one row per output);
 *   in[2] = bias [N], or an empty tensor for none; x, W and bias share one float dtype;
 *   in[3] = workspace, int32: empty when K is not split (S = 1), else T arrival counters (zero
 *           between tasks: the last arrival resets its counter), padded to a multiple of 4
 *           words, then S * T partial blocks of P x 64 fp32, T = MB * NT tiles;
 *   out [..., N] with x's leading dims, any float dtype; computed in fp32.
 * Tiles: an m-block is 64 rows of x (MB = ceil(M / 64)), an n-tile 64 outputs (NT = ceil(N / 64)),
 * P = min(M, 64) rounded up to 16. K is cut into S splits of kch steps of 32 (kch =
 * ceil(ceil(K / 32) / S) rounded up to 8; every split has at least one step); S follows from the
 * workspace's length.
 * A work item is one (m-block, split, n-tile), numbered i = (nt * S + s) * MB + mb (neighbouring
 * items share a tile of W, or a tile's splits); a record covers items [range_begin, range_end).
 *
 * Split-K combine, deterministic: every split stores its fp32 partial block, fences, and its
 * block adds one to the tile's counter (atomicInc wraps at S, so the counter is back to zero
 * after the last); the block that sees S - 1 sums the S blocks in split order, adds the bias and
 * writes out. A task must not run concurrently with itself (a second run would share counters).
 *
 * Tensor-core path (fp16/bf16, K > 0 and K % 8 == 0, 16-byte aligned rows of x and W, rows of x
 * and of out one stride apart, blockDim >= 256): 8 warps each own 8 rows of the n-tile; mma.sync
 * m16n8k16 with x as A (m16 tiles of rows, 1 to 4 by the m-block's size) and W as B, so that a
 * warp's W fragment is one 16-byte load per lane per step: lane (g, q) loads
 * W[row g][k + 8q .. k + 8q + 7] and x likewise, and the two products of a step read those 8
 * values in an order permuted consistently for A and B (the dot product does not care).
 * Memory: W streams straight into registers through a ring GPUOS_LINEAR_RING steps deep
 * (ld.global.nc, read once; 16 KB in flight per SM) and is prefetched into L2 16 to 24 steps
 * ahead (one bulk prefetch per row on sm_90), so that the ring's loads hit L2; x goes through 3
 * stages of shared memory (cp.async.cg: L2, never a stale L1 line) shared by the 8 warps. Both
 * streams run on across the items of a record, so an item's epilogue overlaps the next item's
 * loads. Registers: 96 (the NVRTC cap); static shared memory 24,676 bytes (stages 24 KB:
 * an x stage of 32 or 64 rows then spans 4 or 2 steps, a barrier per stage, not per step).
 * Anything else (fp32, odd strides or alignment, K = 0, small blocks) takes the CUDA-core path:
 * one thread per output, same items, same combine. */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */

#define GPUOS_LINEAR_BM 64          /* rows of x per m-block */
#define GPUOS_LINEAR_BN 64          /* outputs per n-tile */
#define GPUOS_LINEAR_WARPS 8        /* warps of the tensor-core path: 8 rows of W each */
#define GPUOS_LINEAR_KSTEP 32       /* k per step: two m16n8k16 products */
#define GPUOS_LINEAR_STEP_ALIGN 8   /* a split's steps come in multiples of this */
#define GPUOS_LINEAR_PART_ROWS 16   /* partial blocks have rows rounded up to this */
#define GPUOS_LINEAR_STAGES 3       /* x stages in shared memory */
#define GPUOS_LINEAR_STAGE_BYTES 8192
#define GPUOS_LINEAR_MMA_THREADS (GPUOS_LINEAR_WARPS * GPUOS_WARP)
/* W is prefetched into L2 this many steps at a time, twice that ahead of its loads. */
#define GPUOS_LINEAR_PREFETCH GPUOS_LINEAR_STEP_ALIGN
/* Bytes of W a record asks L2 for before its x is ready (gpuos_linear_warm). */
#define GPUOS_LINEAR_WARM_BYTES 65536
/* Steps of W each lane keeps in flight in registers (16 bytes each). 8 would double the bytes in
 * flight, but spills ring slots right after their loads in the operator as the worker calls it
 * (an ABI function, 64 registers when this was measured): a spill store waits for its load and stalls the warp. */
#define GPUOS_LINEAR_RING 4

/* What one task's records share, computed once per record by thread 0 into shared memory. */
struct GpuosLinearPlan {
  int m, n, k;          /* rows of x, outputs, inner dim */
  int mblocks, ntiles;  /* m-blocks and n-tiles */
  int splits, kch;      /* K splits and steps per split */
  int prows;            /* rows of a partial block */
  int64_t xrs, ors;     /* elements between rows of x and of out, -1 when no one stride serves */
  bool fast;            /* the tensor-core path applies */
};

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

/* Whether the tensor-core path can run the task: see the header comment. */
__device__ __forceinline__ bool gpuos_linear_fast(const GpuosTask* t, const GpuosLinearPlan& p) {
  const GpuosTensorRef &x = t->in[0], &w = t->in[1];
  const bool half = x.dtype == GPUOS_DTYPE_F16 || x.dtype == GPUOS_DTYPE_BF16;
  const bool rows = p.xrs >= 0 && p.xrs % 8 == 0 && p.ors >= 0 && w.strides[0] % 8 == 0;
  const bool unit = x.strides[x.ndim - 1] == 1 && w.strides[1] == 1;
  const bool aligned = p.k % 8 == 0 && gpuos_aligned16(x.data) && gpuos_aligned16(w.data);
  return GPUOS_SM80 && half && x.dtype == w.dtype && rows && unit && aligned && p.k > 0 &&
         blockDim.x >= GPUOS_LINEAR_MMA_THREADS;
}

__device__ __forceinline__ GpuosLinearPlan gpuos_linear_plan(const GpuosTask* t) {
  const GpuosTensorRef &x = t->in[0], &ws = t->in[3];
  GpuosLinearPlan p;
  p.m = static_cast<int>(gpuos_numel_dims(x, (1u << gpuos_row_dims(x)) - 1u));
  p.n = static_cast<int>(t->in[1].sizes[0]);
  p.k = static_cast<int>(gpuos_row_len(x));
  p.mblocks = (p.m + GPUOS_LINEAR_BM - 1) / GPUOS_LINEAR_BM;
  p.ntiles = (p.n + GPUOS_LINEAR_BN - 1) / GPUOS_LINEAR_BN;
  p.prows = (min(p.m, GPUOS_LINEAR_BM) + GPUOS_LINEAR_PART_ROWS - 1) & -GPUOS_LINEAR_PART_ROWS;
  const unsigned tiles = p.mblocks * p.ntiles, block = tiles * p.prows * GPUOS_LINEAR_BN;
  const unsigned partials = static_cast<unsigned>(ws.numel) - gpuos_linear_counters(tiles);
  p.splits = ws.numel == 0 ? 1 : static_cast<int>(partials / block);
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
  it.rows = min(GPUOS_LINEAR_BM, p.m - GPUOS_LINEAR_BM * it.mb);
  it.k0 = it.s * p.kch * GPUOS_LINEAR_KSTEP;
  it.k1 = min(p.k, it.k0 + p.kch * GPUOS_LINEAR_KSTEP);
  const int k = it.k1 - it.k0;
  const int steps = k > 0 ? (k + GPUOS_LINEAR_KSTEP - 1) / GPUOS_LINEAR_KSTEP : 0;
  it.steps = (steps + GPUOS_LINEAR_STEP_ALIGN - 1) & -GPUOS_LINEAR_STEP_ALIGN;
  return it;
}

/* ---- outputs: final values and the split-K combine ------------------------------------------ */

/* out[m][n] = v + bias[n]. UNIFORM: rows of out are p.ors apart (the tensor-core path's
 * condition), which spares every store a walk over out's dims. */
template <bool UNIFORM>
__device__ __forceinline__ void gpuos_linear_final(const GpuosTask* t, const GpuosLinearPlan& p,
                                                   int m, int n, float v) {
  const GpuosTensorRef &o = t->out, &b = t->in[2];
  if (b.numel != 0) v += gpuos_load(b, n * b.strides[0]);
  gpuos_store(o, UNIFORM ? m * p.ors + n * o.strides[o.ndim - 1] : gpuos_row_offset(o, m, n), v);
}

/* Partial block of split s of tile (mb, nt): P rows of GPUOS_LINEAR_BN fp32, 16-byte aligned. */
__device__ __forceinline__ float* gpuos_linear_part(const GpuosTask* t, const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it, int s) {
  const int64_t tiles = static_cast<int64_t>(p.mblocks) * p.ntiles;
  const int64_t block = (s * tiles + it.nt * p.mblocks + it.mb) * p.prows * GPUOS_LINEAR_BN;
  return reinterpret_cast<float*>(t->in[3].data) + gpuos_linear_counters(tiles) + block;
}

/* Value v of output (row r, column c) of the item's tile: final when K is not split, else its
 * split's partial. */
template <bool UNIFORM>
__device__ __forceinline__ void gpuos_linear_emit(const GpuosTask* t, const GpuosLinearPlan& p,
                                                  const GpuosLinearItem& it, int r, int c,
                                                  float v) {
  if (p.splits == 1) {
    gpuos_linear_final<UNIFORM>(t, p, GPUOS_LINEAR_BM * it.mb + r, GPUOS_LINEAR_BN * it.nt + c, v);
  } else {
    gpuos_linear_part(t, p, it, it.s)[r * GPUOS_LINEAR_BN + c] = v;
  }
}

/* The tile's outputs from its S partial blocks, summed in split order (4 splits' loads in flight
 * at a time), by all threads. */
template <bool UNIFORM>
__device__ __forceinline__ void gpuos_linear_combine(const GpuosTask* t, const GpuosLinearPlan& p,
                                                     const GpuosLinearItem& it) {
  const int64_t plane = static_cast<int64_t>(p.mblocks) * p.ntiles * p.prows * GPUOS_LINEAR_BN;
  const float* first = gpuos_linear_part(t, p, it, 0);
  GPUOS_ROLLED
  for (int i = threadIdx.x; i < it.rows * (GPUOS_LINEAR_BN / 4); i += blockDim.x) {
    const int r = i / (GPUOS_LINEAR_BN / 4), c = 4 * (i % (GPUOS_LINEAR_BN / 4));
    const float* at = first + r * GPUOS_LINEAR_BN + c;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    GPUOS_ROLLED
    for (int s0 = 0; s0 < p.splits; s0 += GPUOS_ILP) {
      float4 v[GPUOS_ILP];
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) {
        const int s = s0 + u < p.splits ? s0 + u : s0;
        v[u] = __ldcg(reinterpret_cast<const float4*>(at + s * plane));
      }
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) {
        if (s0 + u >= p.splits) continue;
        sum[0] += v[u].x, sum[1] += v[u].y, sum[2] += v[u].z, sum[3] += v[u].w;
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = GPUOS_LINEAR_BN * it.nt + c + e;
      if (n < p.n) gpuos_linear_final<UNIFORM>(t, p, GPUOS_LINEAR_BM * it.mb + r, n, sum[e]);
    }
  }
}

/* After every thread emitted the item's values: with K split, count this split in and, in the
 * block that completes the tile, combine it. All threads call; `last` is shared scratch (read
 * here before any thread can pass the next call's first barrier, where it is rewritten). */
template <bool UNIFORM>
__device__ __forceinline__ void gpuos_linear_arrive(const GpuosTask* t, const GpuosLinearPlan& p,
                                                    const GpuosLinearItem& it, int* last) {
  if (p.splits == 1) return;
  __threadfence(); /* this thread's partials are visible before the count that announces them */
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* counters = reinterpret_cast<unsigned int*>(t->in[3].data);
    const unsigned int seen = atomicInc(counters + it.nt * p.mblocks + it.mb, p.splits - 1);
    *last = seen == static_cast<unsigned int>(p.splits - 1);
  }
  __syncthreads();
  if (*last) {
    __threadfence(); /* the other splits' partials, fenced before their counts, are read after */
    gpuos_linear_combine<UNIFORM>(t, p, it);
  }
}

/* ---- the CUDA-core path --------------------------------------------------------------------- */

__device__ __forceinline__ void gpuos_linear_generic(const GpuosTask* t, const GpuosLinearPlan& p,
                                                     int* last) {
  const GpuosTensorRef &x = t->in[0], &w = t->in[1];
  GPUOS_ROLLED
  for (int64_t i = t->range_begin; i < t->range_end; ++i) {
    const GpuosLinearItem it = gpuos_linear_item(p, static_cast<int>(i));
    GPUOS_ROLLED
    for (int o = threadIdx.x; o < it.rows * GPUOS_LINEAR_BN; o += blockDim.x) {
      const int r = o / GPUOS_LINEAR_BN, c = o % GPUOS_LINEAR_BN, n = GPUOS_LINEAR_BN * it.nt + c;
      if (n >= p.n) continue;
      const char* xp = gpuos_ptr(x, gpuos_row_offset(x, GPUOS_LINEAR_BM * it.mb + r, it.k0));
      const char* wp = gpuos_ptr(w, n * w.strides[0] + it.k0 * w.strides[1]);
      const int64_t xstep = gpuos_step(x, x.ndim - 1), wstep = gpuos_step(w, 1);
      float sum = 0.0f;
      GPUOS_ROLLED
      for (int k = it.k0; k < it.k1; ++k, xp += xstep, wp += wstep)
        sum += gpuos_load_ptr(xp, x.dtype) * gpuos_load_ptr(wp, w.dtype);
      gpuos_linear_emit<false>(t, p, it, r, c, sum);
    }
    gpuos_linear_arrive<false>(t, p, it, last);
  }
}

/* ---- the tensor-core path ------------------------------------------------------------------- */

__device__ __forceinline__ unsigned int gpuos_smem_address(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

/* 16 bytes into shared memory, from global memory through L2 only; `bytes` 0 writes zeros. */
__device__ __forceinline__ void gpuos_cp_async16(unsigned int dst, const void* src, int bytes) {
#if GPUOS_SM80
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
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

/* 16 bytes of a weight, through the read-only path without keeping them in L1 (read once). */
__device__ __forceinline__ uint4 gpuos_ld_weight16(const char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/* Ask L2 for `bytes` (a multiple of 16) from p (16-byte aligned), by one thread: one bulk
 * prefetch on sm_90 (the copy engine keeps it in flight, no register or load slot), else one
 * prefetch per 128-byte line. */
__device__ __forceinline__ void gpuos_prefetch_l2(const char* p, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  GPUOS_ROLLED
  for (int at = 0; at < bytes; at += 128) gpuos_prefetch_line(p + at);
#endif
}

/* Ask L2 for `bytes` (a multiple of 16, at most 512) of a weight row from p (16-byte aligned):
 * one bulk prefetch by lane q == 0 on sm_90, else one 128-byte line from each of the 4 lanes q
 * of the row. */
__device__ __forceinline__ void gpuos_prefetch_row(const char* p, int bytes, int q) {
#if __CUDA_ARCH__ >= 900
  if (q == 0 && bytes > 0) gpuos_prefetch_l2(p, bytes);
#else
  if (128 * q < bytes) gpuos_prefetch_line(p + 128 * q);
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

/* One lane's walk along k of a row of W through the items of a record: the 16-bit element at p,
 * and how many elements of the item's k range remain from there (<= 0: past its end, or the row
 * does not exist; nothing is loaded then). */
struct GpuosLinearCursor {
  const char* p;
  int left;

  __device__ __forceinline__ void step(int elements) { p += 2 * elements, left -= elements; }
};

/* Row `row` (of the item's n-tile) of W at element `kofs` of item i's k range. */
__device__ __forceinline__ GpuosLinearCursor gpuos_linear_w_at(const GpuosTask* t,
                                                                const GpuosLinearPlan& p, int i,
                                                                int row, int kofs) {
  const GpuosLinearItem it = gpuos_linear_item(p, i);
  const int n = GPUOS_LINEAR_BN * it.nt + row;
  const bool exists = i < t->range_end && row < GPUOS_LINEAR_BN && n < p.n;
  GpuosLinearCursor c;
  c.p = reinterpret_cast<const char*>(t->in[1].data) + 2 * (n * t->in[1].strides[0] + it.k0 + kofs);
  c.left = exists ? it.k1 - it.k0 - kofs : 0;
  return c;
}

/* 16 bytes of shared memory at 32-bit shared address `a`. */
__device__ __forceinline__ uint4 gpuos_lds16(unsigned int a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}

/* The x stages: buffers of R rows of KC elements, at most D steps (a stage starts at a step of
 * the ring's first slot); 16-byte chunk c of row r sits at chunk c ^ 4 (r & 1) when rows span 128
 * bytes or more, so that the 8 lanes of each quarter warp (rows g, g + 1, chunks q .. q + 3 of
 * one step) hit 8 different bank groups. */
template <int R, int D>
struct GpuosLinearStages {
  static constexpr int KC = GPUOS_LINEAR_STAGE_BYTES / (2 * R) < D * GPUOS_LINEAR_KSTEP
                                ? GPUOS_LINEAR_STAGE_BYTES / (2 * R)
                                : D * GPUOS_LINEAR_KSTEP; /* elements of a row */
  static constexpr int PITCH = 2 * KC;                           /* bytes of a row */
  static constexpr int CHUNKS = KC / 8;                          /* 16-byte chunks of a row */
  static constexpr int STEPS = KC / GPUOS_LINEAR_KSTEP;          /* steps a stage covers */
  static constexpr int SWIZZLE = CHUNKS >= 8 ? 4 : 0;
  __device__ static int offset(int r, int chunk) {
    return r * PITCH + 16 * (chunk ^ (r & 1 ? SWIZZLE : 0));
  }
};

/* Where an x stage comes from, the same for every thread: the stage's item, rows and first
 * element. Thread 0 moves it on from one stage to the next (see gpuos_linear_issue_x). */
struct GpuosLinearXStage {
  int item;    /* its item (range_end and past: none, rows is 0) */
  int row0;    /* first row of x of the item's m-block */
  int rows;    /* rows of x in it */
  int k, k1;   /* first element of the stage; end of the item's k range */
  int stages;  /* stages of the item from this one on */
};

__device__ __forceinline__ GpuosLinearXStage gpuos_linear_x_stage(const GpuosTask* t,
                                                                  const GpuosLinearPlan& p, int i,
                                                                  int kc) {
  const GpuosLinearItem it = gpuos_linear_item(p, i);
  GpuosLinearXStage x;
  x.item = i;
  x.row0 = GPUOS_LINEAR_BM * it.mb;
  x.rows = i < t->range_end ? it.rows : 0;
  x.k = it.k0;
  x.k1 = it.k1;
  x.stages = it.steps * GPUOS_LINEAR_KSTEP / kc;
  return x;
}

/* Issue x stage number n into shared address `stage`: each thread copies its 16 bytes, zeros
 * past the item's k range or rows (pad steps and absent rows then add nothing; threads past the
 * stage copy nothing), and thread 0 writes where stage n + 1 comes from into the other slot of
 * `xs`. Callers separate consecutive issues by a barrier: it publishes that slot, and every
 * thread has read slot n & 1 before it is rewritten for stage n + 2. */
template <int R, int D>
__device__ __forceinline__ void gpuos_linear_issue_x(const GpuosTask* t, const GpuosLinearPlan& p,
                                                     GpuosLinearXStage* xs, int n,
                                                     unsigned int stage) {
  using St = GpuosLinearStages<R, D>;
  const GpuosLinearXStage x = xs[n & 1];
  const char* x0 = reinterpret_cast<const char*>(t->in[0].data);
  for (int c = threadIdx.x; c < R * St::CHUNKS; c += blockDim.x) {
    const int row = c / St::CHUNKS, kofs = 8 * (c % St::CHUNKS);
    const bool in = row < x.rows && x.k + kofs < x.k1;
    const char* src = x0 + 2 * ((x.row0 + row) * p.xrs + x.k + kofs);
    gpuos_cp_async16(stage + St::offset(row, c % St::CHUNKS), in ? src : x0, in ? 16 : 0);
  }
  gpuos_cp_async_commit();
  if (threadIdx.x == 0) {
    GpuosLinearXStage next = x;
    next.k += St::KC;
    xs[(n + 1) & 1] = --next.stages > 0 ? next : gpuos_linear_x_stage(t, p, x.item + 1, St::KC);
  }
}

/* Prefetch into L2 the GPUOS_LINEAR_PREFETCH steps of W starting at this lane's cursor (its
 * row's block: the lane's 16 bytes sit 8 q elements into it). */
__device__ __forceinline__ void gpuos_linear_prefetch(const GpuosLinearCursor& at, int q) {
  constexpr int BLOCK = GPUOS_LINEAR_PREFETCH * GPUOS_LINEAR_KSTEP;
  gpuos_prefetch_row(at.p - 16 * q, 2 * min(BLOCK, at.left + 8 * q), q);
}

/* The items of the record on tensor cores. R: rows of an m-block rounded up (8, 16, 32, 64);
 * D: steps of W in flight in registers. Warps past GPUOS_LINEAR_WARPS (blocks over 256 threads)
 * run the same loop on rows past the tile: they load nothing and emit nothing. */
template <int R, int D, bool BF16>
__device__ __forceinline__ void gpuos_linear_mma(const GpuosTask* t, const GpuosLinearPlan& p,
                                                 char* stages, GpuosLinearXStage* xstage,
                                                 int* last) {
  using St = GpuosLinearStages<R, D>;
  constexpr int TILES = R < 16 ? 1 : R / 16; /* m16 tiles of x */
  constexpr int PF = GPUOS_LINEAR_PREFETCH, AHEAD = 2 * GPUOS_LINEAR_PREFETCH;
  constexpr int STEP = GPUOS_LINEAR_KSTEP, NS = GPUOS_LINEAR_STAGES;
  static_assert(GPUOS_LINEAR_STEP_ALIGN % D == 0, "items have whole rounds of the ring");
  const int warp = threadIdx.x / GPUOS_WARP, lane = threadIdx.x % GPUOS_WARP;
  const int g = lane >> 2, q = lane & 3, wrow = 8 * warp + g;
  const int begin = static_cast<int>(t->range_begin), end = static_cast<int>(t->range_end);
  const unsigned int base = gpuos_smem_address(stages);

  /* W: this lane's 16 bytes of row wrow per step, D steps ahead of the products (a predicated
   * load leaves a slot's earlier weights, which meet zeros of x past the k range), prefetched
   * into L2 AHEAD steps ahead of that; the first item's first AHEAD steps now. */
  GpuosLinearCursor w = gpuos_linear_w_at(t, p, begin, wrow, 8 * q);
  GpuosLinearCursor at = w;
#pragma unroll
  for (int b = 0; b < AHEAD / PF; ++b, at.step(PF * STEP)) gpuos_linear_prefetch(at, q);
  uint4 ring[D];
#pragma unroll
  for (int u = 0; u < D; ++u, w.step(STEP)) {
    ring[u] = make_uint4(0, 0, 0, 0);
    if (w.left > 0) ring[u] = gpuos_ld_weight16(w.p);
  }
  /* x: NS - 1 stages ahead of the products, running on into the next item when one ends. */
  int issued = 0;
  if (threadIdx.x == 0) xstage[0] = gpuos_linear_x_stage(t, p, begin, St::KC);
#pragma unroll
  for (int s = 0; s < NS - 1; ++s, ++issued) {
    __syncthreads();
    gpuos_linear_issue_x<R, D>(t, p, xstage, issued, base + s * GPUOS_LINEAR_STAGE_BYTES);
  }

  /* This lane's x in a stage: rows g (+ 8, + 16 a) at chunk 4 js + q, at 64 js past one of two
   * base offsets (the swizzle flips chunk bit 2, which the parity of js sets). */
  const unsigned int even = St::offset(g, q), odd = St::offset(g, 4 + q) - 64;
  int consume = 0; /* stage buffer read next */
  unsigned int xs = base;
  GPUOS_ROLLED
  for (int i = begin; i < end; ++i) {
    const int steps = gpuos_linear_item(p, i).steps; /* the rest is decoded again after the loop */
    float acc[TILES][4];
#pragma unroll
    for (int a = 0; a < TILES; ++a) acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = 0.0f;
    GPUOS_ROLLED
    for (int j0 = 0; j0 < steps; j0 += D) {
#pragma unroll
      for (int u = 0; u < D; ++u) {
        const int j = j0 + u, js = u % St::STEPS;
        if (js == 0) { /* a new stage: wait for it, then refill the one just read */
          gpuos_cp_async_wait<NS - 2>();
          __syncthreads();
          const int refill = consume == 0 ? NS - 1 : consume - 1;
          const unsigned int into = base + refill * GPUOS_LINEAR_STAGE_BYTES;
          gpuos_linear_issue_x<R, D>(t, p, xstage, issued++, into);
          xs = base + consume * GPUOS_LINEAR_STAGE_BYTES;
          consume = consume == NS - 1 ? 0 : consume + 1;
        }
        if (j % PF == 0) { /* W at steps j + AHEAD .., maybe the next item's */
          const bool here = j + AHEAD < steps;
          GpuosLinearCursor ahead = here ? w : gpuos_linear_w_at(t, p, i + 1, wrow, 8 * q);
          ahead.step(STEP * (here ? AHEAD - D : j + AHEAD - steps));
          gpuos_linear_prefetch(ahead, q);
        }
        const unsigned int xl = xs + (js & 1 ? odd : even) + 64 * js;
        const uint4 b = ring[u];
#pragma unroll
        for (int a = 0; a < TILES; ++a) {
          const uint4 lo = gpuos_lds16(xl + 16 * a * St::PITCH);
          const uint4 hi =
              R < 16 ? make_uint4(0, 0, 0, 0) : gpuos_lds16(xl + (16 * a + 8) * St::PITCH);
          gpuos_mma16816<BF16>(acc[a], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
          gpuos_mma16816<BF16>(acc[a], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
        }
        if (j + D == steps) w = gpuos_linear_w_at(t, p, i + 1, wrow, 8 * q);
        if (w.left > 0) ring[u] = gpuos_ld_weight16(w.p);
        w.step(STEP);
      }
    }
    /* acc[a][e]: row 16 a + g (+ 8 for e >= 2) of x, output 8 warp + 2 q (+ 1 for odd e) */
    const GpuosLinearItem it = gpuos_linear_item(p, i);
#pragma unroll
    for (int a = 0; a < TILES; ++a) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * a + g + 8 * (e >> 1), c = 8 * warp + 2 * q + (e & 1);
        if (r < it.rows && c < GPUOS_LINEAR_BN && GPUOS_LINEAR_BN * it.nt + c < p.n)
          gpuos_linear_emit<true>(t, p, it, r, c, acc[a][e]);
      }
    }
    GPUOS_MARK(1);
    gpuos_linear_arrive<true>(t, p, it, last);
  }
  gpuos_cp_async_wait<0>(); /* no copy may land in the stages after the operator returned */
}

template <int R, int D>
__device__ __forceinline__ void gpuos_linear_mma_dtype(const GpuosTask* t, const GpuosLinearPlan& p,
                                                       char* stages, GpuosLinearXStage* xstage,
                                                       int* last) {
  if (t->in[0].dtype == GPUOS_DTYPE_BF16) {
    gpuos_linear_mma<R, D, true>(t, p, stages, xstage, last);
  } else {
    gpuos_linear_mma<R, D, false>(t, p, stages, xstage, last);
  }
}

/* Ask L2 for the weights of the record's first items, about GPUOS_LINEAR_WARM_BYTES (at least
 * one item), each W row's k range once (items of other m-blocks share it), a row per thread at a
 * time: issued before the record's x is ready (GPUOS_TASK_EARLY), they stream in while the
 * producers still run. Capped so that the records of a matrix larger than L2 (an LM head) do
 * not evict each other's; the main loop's own prefetch takes over from there. Tensor-core path
 * only (its rows are 16-byte aligned and whole multiples of 16 bytes). */
__device__ __forceinline__ void gpuos_linear_warm(const GpuosTask* t, const GpuosLinearPlan& p) {
  const int begin = static_cast<int>(t->range_begin);
  const int item_bytes = GPUOS_LINEAR_BN * 2 * GPUOS_LINEAR_KSTEP * p.kch;
  const int items = max(1, GPUOS_LINEAR_WARM_BYTES / item_bytes);
  const int end = min(static_cast<int>(t->range_end), begin + items);
  GPUOS_ROLLED
  for (int r = threadIdx.x; r < (end - begin) * GPUOS_LINEAR_BN; r += blockDim.x) {
    const int i = begin + r / GPUOS_LINEAR_BN, row = r % GPUOS_LINEAR_BN;
    const GpuosLinearItem it = gpuos_linear_item(p, i);
    const int n = GPUOS_LINEAR_BN * it.nt + row;
    if ((it.mb != 0 && i != begin) || n >= p.n || it.k1 <= it.k0) continue;
    const char* w = reinterpret_cast<const char*>(t->in[1].data) + 2 * (n * t->in[1].strides[0] + it.k0);
    gpuos_prefetch_l2(w, 2 * (it.k1 - it.k0));
  }
}

__device__ __forceinline__ void gpuos_linear(const GpuosTask* t) {
  __shared__ GpuosLinearPlan plan;
  __shared__ GpuosLinearXStage xstage[2];
  __shared__ int last;
  __shared__ __align__(128) char stages[GPUOS_LINEAR_STAGES * GPUOS_LINEAR_STAGE_BYTES];
  if (t->range_begin >= t->range_end) { /* no items (an empty x or W): uniform */
    gpuos_await(t);
    return;
  }
  /* GPUOS_TASK_EARLY: the plan (from the descriptor alone) and the weights (no producer writes
   * them) come before the wait for x */
  if (threadIdx.x == 0) plan = gpuos_linear_plan(t);
  __syncthreads();
  GPUOS_MARK(0);
  if (plan.fast) gpuos_linear_warm(t, plan);
  gpuos_await(t);
  const int rows = min(plan.m, GPUOS_LINEAR_BM);
  if (!plan.fast) {
    gpuos_linear_generic(t, plan, &last);
  } else if (rows <= 8) {
    gpuos_linear_mma_dtype<8, GPUOS_LINEAR_RING>(t, plan, stages, xstage, &last);
  } else if (rows <= 16) {
    gpuos_linear_mma_dtype<16, GPUOS_LINEAR_RING>(t, plan, stages, xstage, &last);
  } else if (rows <= 32) {
    gpuos_linear_mma_dtype<32, GPUOS_LINEAR_RING>(t, plan, stages, xstage, &last);
  } else {
    gpuos_linear_mma_dtype<64, GPUOS_LINEAR_RING>(t, plan, stages, xstage, &last);
  }
}

#define GPUOS_DEFINE_LINEAR(SYMBOL) \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) { gpuos_linear(t); }
