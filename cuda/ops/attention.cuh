/* attention.cuh: single-query attention decode, split over the KV length (flash-decoding).
 *
 * Contract (host encoding: gpuos_core/families.py, AttentionFamily and AttentionPlan):
 *   in[0] = q [..., D], in[1] = K [..., L, D], in[2] = V [..., L, D], leading dims equal after
 *           expansion (grouped-query heads are stride-0 broadcasts of K and V); rows are numbered
 *           row-major over them; 1 <= D <= GPUOS_ATTN_MAX_D, L >= 1;
 *   in[3] = lengths, int32 [..., 1]: one per row (stride-0 broadcasts), read on the device at
 *           every run (n = min(lengths[row], L); out = 0 when n <= 0); the host puts L there when
 *           the caller gave none. Its last dim has size 1, so no element is addressed through its
 *           stride, which instead holds the address of the task's workspace in int32 words (the
 *           ABI has no fifth input). The workspace, int32: GPUOS_ATTN_HEADER words (G, NQ, C, S,
 *           W, N, R, a zero, then from word GPUOS_ATTN_NEWEST two GpuosTensorRefs when N != 0:
 *           new_k and new_v [..., D] over q's leading dims, K's and V's dtype and last stride),
 *           then one arrival counter per group (zero between tasks: the last arrival resets
 *           it), padded to a multiple of 4 words, then S * groups partials when S > 1. With N,
 *           a row's newest key and value (at n - 1) are new_k's and new_v's rows, not K's and V's;
 *   out [..., D]; scalars[0] = scale.
 * Plan: the innermost G rows over which K and V (and lengths, unless R) do not move share one pass
 * over their keys; they form ceil(G / NQ) groups of at most NQ rows (queries). The keys [0, L) are
 * cut into S splits of C keys (a multiple of GPUOS_ATTN_ALIGN); work item i is (group i / S,
 * split i % S) and a record covers items [range_begin, range_end). The host picks C and S from
 * shapes only, so a program keeps its records when lengths change: splits at or past an item's
 * length return at once, and an item with n keys has A = ceil(n / C) active splits. With R
 * (ragged: a prefill chunk's rows over their slot's keys, never with N), an item's rows each have
 * a length of their own, its n their longest: query j's scores past its own length are masked, and
 * a query without keys in a split, or at all, leaves a partial with no weight, or zeros.
 *
 * Block mode (W = 0): the block takes the record's items one after another; in an item, warp w
 * of the first GPUOS_ATTN_WARPS takes 16-key tiles w, w + 8, ... of the split with an online
 * softmax (running max m and sum l per query, accumulators rescaled when m grows), and the warps'
 * states are merged in warp order. Warp mode (W = 1, for many groups of short splits, where an
 * item's serial latency and not its keys is the cost): each warp takes whole items, the tiles of
 * its split one after another; the record's items that have keys (read from the lengths as they
 * are, 32 at a time by the lanes) are dealt to the warps in turn, so ragged rows spread evenly.
 * It needs the tensor-core path and GPUOS_ATTN_WARPS staging areas in dynamic shared memory;
 * without them the block mode runs the same items. In either mode, with A = 1 the item's
 * outputs go to out; otherwise it stores its partial (m, l, o per query) and counts itself in
 * on the group's counter (gpuos_count_in, which wraps at A); the block or warp that arrives last
 * combines the A partials in split order. Every step has a fixed order, so results are bitwise
 * reproducible. A task must not run concurrently with itself (a second run would share the
 * counters).
 *
 * Tensor-core path (q, K, V all fp16 or all bf16, D in {32, 64, 128, 256}, K and V rows
 * contiguous and 16-byte aligned): scores of a tile are m16n8k16 products, K as A (lane (g, c)
 * loads 16 bytes of keys g and g + 8 per 32 dims, as linear.cuh loads W) and the group's queries
 * as B from shared memory; lane (g, c) then holds the scores of keys g, g + 8 for queries 2c,
 * 2c + 1. For D <= 64 the value pass is m16n8k16 products too, O^T += V^T P^T: V's rows are
 * loaded as K's are and each 8 x 8 block of them transposed in registers (movmatrix), so that
 * lane (g, c) holds, per 16 dims, the outputs of dims as gpuos_attn_tc_dim numbers them for
 * queries 2c, 2c + 1, and the probabilities are transposed likewise into B: nothing goes through
 * shared memory until the scan ends. For D >= 128 probabilities go through shared memory to a
 * value pass on CUDA cores, where lane i owns dims [i D / 32, (i + 1) D / 32) of every query and
 * loads them of each key with one load. Either way a warp's scan ends with its outputs [query]
 * [dim] in its GPUOS_ATTN_OUT_SMEM bytes of gpuos_dynamic_smem (its area), which the store reads
 * (warp mode), or each thread of the block its outputs' over the warps' areas (block mode: the
 * merge and the store one pass). The next tile's rows are prefetched into L2 while this one is
 * computed. Anything else takes the CUDA-core path: one key per warp at a time, the same items,
 * merge (through shared o) and combine. The offsets of an item's rows in q and out are worked
 * out before its queries are staged (gpuos_attn_rows_of).
 * Registers: at most GPUOS_ATTN_ACC accumulators per lane, so NQ = min(8, 16 / (D / 32)) (D / 32
 * rounded up to a power of two); 128 registers in all (the NVRTC cap). Static shared memory:
 * about 7 KB; the tensor-core path also needs GPUOS_ATTN_WARPS (GPUOS_ATTN_WARP_SMEM +
 * GPUOS_ATTN_OUT_SMEM) bytes of dynamic shared memory. Needs blockDim >= 32 GPUOS_ATTN_WARPS
 * (the worker's 256 threads). */
#pragma once

#include "gpuos_device.cuh" /* found through -I<repo>/cuda */
#include "ops/linear.cuh"   /* the m16n8k16 product and shared-memory loads */

#define GPUOS_ATTN_MAX_D 256
#define GPUOS_ATTN_WARPS 8    /* warps that scan keys; a larger block's other warps only merge */
#define GPUOS_ATTN_TILE 16    /* keys of a warp's tile: the M of one product */
#define GPUOS_ATTN_ALIGN (GPUOS_ATTN_TILE * GPUOS_ATTN_WARPS) /* a split's keys come in these */
#define GPUOS_ATTN_MAX_Q 8    /* queries of an item: the N of one product */
#define GPUOS_ATTN_ACC 16     /* output accumulators per lane: NQ * D / 32 */
#define GPUOS_ATTN_NEWEST 8   /* workspace word of new_k's ref (new_v's follows) */
#define GPUOS_ATTN_HEADER 68  /* workspace words before the counters: the refs' end */
#define GPUOS_ATTN_VBATCH 8   /* values of this many keys in flight per lane (D >= 128) */
/* Warp mode: each warp's staging area in gpuos_dynamic_smem, its item then its queries (at most
 * 8 rows of 192 bytes, at D = 64). */
#define GPUOS_ATTN_WARP_SMEM 2048
#define GPUOS_ATTN_WARP_Q 320 /* offset of the queries in it */
/* After the staging areas: each warp's outputs [query][dim], fp32, between its scan and the
 * store (GPUOS_ATTN_ACC * 32 floats). */
#define GPUOS_ATTN_OUT_SMEM (GPUOS_ATTN_ACC * GPUOS_WARP * 4)

/* Queries an item takes with NS = D / 32 (a power of two) output dims per lane. */
__host__ __device__ constexpr int gpuos_attn_nq(int ns) {
  return GPUOS_ATTN_ACC / ns < GPUOS_ATTN_MAX_Q ? GPUOS_ATTN_ACC / ns : GPUOS_ATTN_MAX_Q;
}

/* The [L, D] matrix of one row of a [..., L, D] ref: element (l, d) at byte address
 * key(l) + d * dstep, but for key `last`, which sits at `newest` where the task gives its newest
 * keys apart (GPUOS_ATTN_NEWEST). gpuos_seek moves it over the leading dims, numbered like q's
 * rows. */
struct GpuosKeys {
  char* p;
  int64_t lstep;
  int64_t dstep;
  int dtype;
  int last; /* -1: none */
  const GpuosTensorRef* ref;
  const char* newest;

  __device__ __forceinline__ const char* key(int64_t l) const {
    return l == last ? newest : row(l);
  }
  /* The cache's row l, which for key `last` is not the one key() reads (prefetches and walks
   * that never reach it). */
  __device__ __forceinline__ const char* row(int64_t l) const { return p + l * lstep; }
  __device__ __forceinline__ void advance(int d, int64_t i) { p += i * gpuos_step(*ref, d); }
};

__device__ __forceinline__ GpuosKeys gpuos_keys(const GpuosTensorRef& ref) {
  GpuosKeys k;
  k.p = gpuos_data(ref);
  k.lstep = gpuos_step(ref, ref.ndim - 2);
  k.dstep = gpuos_step(ref, ref.ndim - 1);
  k.dtype = ref.dtype;
  k.last = -1;
  k.ref = &ref;
  k.newest = nullptr;
  return k;
}

/* An element offset in `ref`, walked over the dims of a row number with other rows (gpuos_seek):
 * q's and out's rows ride on the seek that finds an item's keys, values and lengths, where
 * gpuos_row_offset of each would be a chain of divisions over every dim of its own. */
struct GpuosAttnOffset {
  int64_t off;
  const GpuosTensorRef* ref;
  __device__ __forceinline__ void advance(int d, int64_t i) { off += i * ref->strides[d]; }
};

/* What the records of one task share, computed once per record by thread 0. */
struct GpuosAttnPlan {
  int lead;               /* leading dims (rows are numbered over them) */
  int64_t rows;           /* rows of q */
  int d, keys;            /* D and L */
  int group, nq;          /* G rows share K and V; at most NQ rows an item */
  int subgroups;          /* groups per G rows: ceil(G / NQ) */
  int chunk, splits;      /* C keys a split, S splits */
  unsigned int* counters; /* a group's arrivals */
  float* parts;           /* partials: (group * S + split) * NQ * (D + 2) floats */
  const GpuosTensorRef* newest; /* new_k's ref (new_v's follows), or nullptr */
  bool fast;              /* the tensor-core path applies */
  bool warps;             /* warp mode: the host asked for it and it can run */
  bool ragged;            /* an item's rows have lengths of their own (R) */
};

/* One work item, the same in every thread. */
struct GpuosAttnItem {
  int64_t row0;     /* its first row */
  int64_t q[GPUOS_ATTN_MAX_Q];   /* element offsets of row row0 + j in q ... */
  int64_t out[GPUOS_ATTN_MAX_Q]; /* ... and in out (gpuos_attn_rows_of) */
  int n[GPUOS_ATTN_MAX_Q];       /* ragged plans: row row0 + j's keys (gpuos_attn_rows_of) */
  int nq;           /* its rows (queries) */
  int group, split;
  int k0, k1;       /* its keys, cut at its length (its rows' longest) */
  int active;       /* splits of the group that have keys: A */
  GpuosKeys k, v;   /* the group's keys and values */
};

/* Shared memory of the operator. The probabilities and the merged outputs are never live
 * together (a barrier separates the last tile from the merge). Arrays first: 16-byte aligned. */
struct GpuosAttnShared {
  float q[GPUOS_ATTN_ACC * GPUOS_WARP]; /* NQ * D staged queries: raw 16-bit or fp32 */
  union {
    struct {
      float p[GPUOS_ATTN_TILE][GPUOS_ATTN_MAX_Q];  /* a tile's probabilities [key][query] */
      float alpha[GPUOS_ATTN_MAX_Q];               /* the tile's rescale of the accumulators */
    } tile[GPUOS_ATTN_WARPS];
    float o[GPUOS_ATTN_ACC * GPUOS_WARP];          /* merged outputs [query][dim] */
  };
  float m[GPUOS_ATTN_WARPS][GPUOS_ATTN_MAX_Q];     /* each warp's running max ... */
  float l[GPUOS_ATTN_WARPS][GPUOS_ATTN_MAX_Q];     /* ... and sum, per query */
  float mall[GPUOS_ATTN_MAX_Q], lall[GPUOS_ATTN_MAX_Q]; /* the merged ones */
  GpuosAttnPlan plan;
  GpuosAttnItem item; /* the current item, from thread 0: no thread keeps it in registers */
  unsigned int round0[GPUOS_ATTN_WARPS]; /* warp mode: gpuos_attn_warm's ballot, per warp */
  int last;           /* this block completed a group */
};

static_assert(sizeof(GpuosAttnItem) <= GPUOS_ATTN_WARP_Q &&
                  GPUOS_ATTN_WARP_Q + GPUOS_ATTN_MAX_Q * 192 <= GPUOS_ATTN_WARP_SMEM,
              "a warp's item and queries fit its staging area");

/* Bytes between consecutive rows of staged 16-bit queries: D * 2, plus 64 when that is a
 * multiple of 128, so that the two rows a quarter warp reads sit in different bank halves. */
__device__ __forceinline__ int gpuos_attn_qpitch(int d) {
  return 2 * d + ((2 * d) % 128 == 0 ? 64 : 0);
}

/* Whether K or V can feed the tensor-core path: contiguous rows, 16-byte aligned. */
__device__ __forceinline__ bool gpuos_attn_rows16(const GpuosTensorRef& r) {
  bool ok = r.strides[r.ndim - 1] == 1 && gpuos_aligned16(r.data);
  GPUOS_ROLLED
  for (int d = 0; d < r.ndim - 1; ++d) ok = ok && (r.strides[d] * 2) % 16 == 0;
  return ok;
}

__device__ __forceinline__ bool gpuos_attn_fast(const GpuosTask* t, int d,
                                                const GpuosTensorRef* newest) {
  const int dt = t->in[0].dtype;
  const bool half = dt == GPUOS_DTYPE_F16 || dt == GPUOS_DTYPE_BF16;
  const bool same = t->in[1].dtype == dt && t->in[2].dtype == dt;
  const bool dims = d == 32 || d == 64 || d == 128 || d == 256;
  const bool smem = gpuos_dynamic_smem_bytes() >=
                    GPUOS_ATTN_WARPS * (GPUOS_ATTN_WARP_SMEM + GPUOS_ATTN_OUT_SMEM);
  const bool apart = newest == nullptr ||
                     (gpuos_attn_rows16(newest[0]) && gpuos_attn_rows16(newest[1]));
  const bool rows = gpuos_attn_rows16(t->in[1]) && gpuos_attn_rows16(t->in[2]) && apart;
  return GPUOS_SM80 && half && same && dims && smem && rows;
}

__device__ __forceinline__ GpuosAttnPlan gpuos_attn_plan(const GpuosTask* t) {
  const GpuosTensorRef &q = t->in[0], &n = t->in[3];
  GpuosAttnPlan p;
  p.lead = gpuos_row_dims(q);
  p.d = static_cast<int>(gpuos_row_len(q));
  p.rows = static_cast<unsigned int>(q.numel) / p.d; /* 32-bit: see gpuos_offset_dims */
  p.keys = static_cast<int>(t->in[1].sizes[t->in[1].ndim - 2]);
  const char* ws = reinterpret_cast<const char*>(n.strides[n.ndim - 1] * 4);
  p.group = gpuos_load_i32(ws);
  p.nq = gpuos_load_i32(ws + 4);
  p.chunk = gpuos_load_i32(ws + 8);
  p.splits = gpuos_load_i32(ws + 12);
  p.subgroups = (p.group + p.nq - 1) / p.nq;
  const unsigned int groups = static_cast<unsigned int>(p.rows) / p.group * p.subgroups;
  p.counters = reinterpret_cast<unsigned int*>(const_cast<char*>(ws)) + GPUOS_ATTN_HEADER;
  p.parts = reinterpret_cast<float*>(p.counters + gpuos_linear_counters(groups));
  p.newest = gpuos_load_i32(ws + 20) == 0
                 ? nullptr
                 : reinterpret_cast<const GpuosTensorRef*>(ws + 4 * GPUOS_ATTN_NEWEST);
  p.fast = gpuos_attn_fast(t, p.d, p.newest);
  p.warps = gpuos_load_i32(ws + 16) != 0 && p.fast; /* its staging areas: fast checked them */
  p.ragged = gpuos_load_i32(ws + 24) != 0;
  return p;
}

/* The item's active splits and its split's keys, for an item of n keys (n clamped to L). */
__device__ __forceinline__ void gpuos_attn_span(const GpuosAttnPlan& p, GpuosAttnItem& it, int n) {
  it.active = n <= 0 ? 0 : (n + p.chunk - 1) / p.chunk;
  it.k0 = it.split * p.chunk;
  it.k1 = min(it.k0 + p.chunk, n);
}

/* Item i; with `newest`, also where its rows' newest key and value sit when the task gives them
 * apart (a deal that only asks whether items are busy needs not seek them). In ragged plans its
 * keys are its first row's until gpuos_attn_rows_of has read the others' lengths. */
__device__ __forceinline__ GpuosAttnItem gpuos_attn_item(const GpuosTask* t,
                                                         const GpuosAttnPlan& p, int64_t i,
                                                         bool newest = true) {
  const unsigned int u = static_cast<unsigned int>(i); /* 32-bit division: no call */
  GpuosAttnItem it;
  it.group = static_cast<int>(u / p.splits);
  it.split = static_cast<int>(u % p.splits);
  const int period = it.group / p.subgroups, sub = it.group % p.subgroups;
  it.row0 = static_cast<int64_t>(period) * p.group + sub * p.nq;
  it.nq = min(p.nq, p.group - sub * p.nq);
  it.k = gpuos_keys(t->in[1]);
  it.v = gpuos_keys(t->in[2]);
  GpuosRow len = gpuos_vector(t->in[3]);
  GpuosAttnOffset q = {0, &t->in[0]}, out = {0, &t->out}; /* out's leading dims are q's */
  gpuos_seek(t->in[0], p.lead, it.row0, it.k, it.v, len, q, out);
  it.q[0] = q.off, it.out[0] = out.off;
  const int n = min(gpuos_load_i32(len.p), p.keys);
  if (newest && p.newest != nullptr) { /* its newest key and value from new_k and new_v */
    GpuosRow nk = gpuos_vector(p.newest[0]), nv = gpuos_vector(p.newest[1]);
    gpuos_seek(t->in[0], p.lead, it.row0, nk, nv);
    it.k.newest = nk.p, it.v.newest = nv.p;
    it.k.last = it.v.last = n - 1;
  }
  it.n[0] = n;
  gpuos_attn_span(p, it, n);
  return it;
}

/* it.q and it.out past the first row (gpuos_attn_item's): the item's rows' offsets in q and out,
 * by the threads first, first + stride, ... (a block's, or a warp's lanes), each a chain of
 * divisions over the leading dims, worked out before the record's wait where the item is known
 * then (gpuos_attn_warm), else before the queries are staged, rather than in front of the
 * queries' loads and behind the scan at the store (~1 us each at one row, ~11 us at the store of
 * a 4-query warp-mode item). In ragged plans also their lengths (it.n) on the same walk, and the
 * item's keys from the longest (by the first warp, whose lanes hold every row: NQ <= 8). */
__device__ __forceinline__ void gpuos_attn_rows_of(const GpuosTask* t, const GpuosAttnPlan& p,
                                                   GpuosAttnItem& it, int first, int stride) {
  int n = 0; /* ragged: the longest of this thread's rows */
  GPUOS_ROLLED
  for (int j = first; j < it.nq; j += stride) {
    if (j == 0) {
      n = it.n[0];
      continue;
    }
    GpuosAttnOffset q = {0, &t->in[0]}, out = {0, &t->out};
    GpuosRow len = gpuos_vector(t->in[3]);
    if (p.ragged) gpuos_seek(t->in[0], p.lead, it.row0 + j, q, out, len);
    else gpuos_seek(t->in[0], p.lead, it.row0 + j, q, out);
    it.q[j] = q.off, it.out[j] = out.off;
    if (p.ragged) {
      it.n[j] = min(gpuos_load_i32(len.p), p.keys);
      n = max(n, it.n[j]);
    }
  }
  if (p.ragged && first < GPUOS_WARP) { /* warp-uniform */
#pragma unroll
    for (int o = 1; o < GPUOS_WARP; o <<= 1) n = max(n, __shfl_xor_sync(GPUOS_ALL_LANES, n, o));
    if (first == 0) gpuos_attn_span(p, it, n);
  }
}

/* Keys [k0, limit) of the item's split that its query j sees: in ragged plans those before its
 * own length. */
__device__ __forceinline__ int gpuos_attn_limit(const GpuosAttnPlan& p, const GpuosAttnItem& it,
                                                int j) {
  return p.ragged && j < it.nq ? min(it.k1, it.n[j]) : it.k1;
}

/* A query's output from its accumulated o and sum l: zeros for one that saw no key (ragged
 * plans: a row without keys in an item whose other rows have some). */
__device__ __forceinline__ float gpuos_attn_ratio(float o, float l) {
  return l > 0.0f ? gpuos_div(o, l) : 0.0f;
}

/* Stage the item's queries in shared memory, rows past it zero, by the threads first,
 * first + stride, ... (a block, or a warp's lanes): on the tensor-core path raw 16-bit rows
 * gpuos_attn_qpitch apart, 8 dims (one 16-byte load where q's rows allow) a thread at a time, so
 * that a warp stages its item in one round trip; else scale * q as fp32 [query][dim]. */
template <int NQ>
__device__ __forceinline__ void gpuos_attn_stage_q(const GpuosTask* t, const GpuosAttnPlan& p,
                                                   const GpuosAttnItem& it, float* qs, int first,
                                                   int stride) {
  const GpuosTensorRef& q = t->in[0];
  const int64_t step = q.strides[q.ndim - 1];
  if (p.fast) { /* D is a multiple of 8 */
    const int chunks = p.d / 8;
    const bool unit = q.strides[q.ndim - 1] == 1;
    GPUOS_ROLLED
    for (int c = first; c < NQ * chunks; c += stride) {
      const int r = c / chunks, k = 8 * (c % chunks);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < it.nq) {
        const char* at = gpuos_ptr(q, it.q[r] + k * step);
        if (unit && gpuos_aligned16(reinterpret_cast<uint64_t>(at))) {
          v = __ldcg(reinterpret_cast<const uint4*>(at));
        } else {
          unsigned int w[4];
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const int64_t lo = it.q[r] + (k + 2 * h) * step, hi = lo + step;
            w[h] = gpuos_ld_u16(gpuos_ptr(q, lo)) | gpuos_ld_u16(gpuos_ptr(q, hi)) << 16;
          }
          v = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
      char* row = reinterpret_cast<char*>(qs) + r * gpuos_attn_qpitch(p.d);
      *reinterpret_cast<uint4*>(row + 2 * k) = v;
    }
    return;
  }
  GPUOS_ROLLED
  for (int i = first; i < NQ * p.d; i += stride) {
    const int r = i / p.d, d = i % p.d;
    const char* at = gpuos_ptr(q, it.q[min(r, it.nq - 1)] + d * step);
    qs[i] = r < it.nq ? t->scalars[0] * gpuos_load_ptr(at, q.dtype) : 0.0f;
  }
}


/* A warp's output accumulators: lane i holds dims NS i + e of query j in v[j][e]. Running maxima
 * and sums are kept by each path in its own layout and published into GpuosAttnShared m and l. */
template <int NQ, int NS>
struct GpuosAttnAcc {
  float v[NQ][NS];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
#pragma unroll
      for (int e = 0; e < NS; ++e) v[j][e] = 0.0f;
    }
  }
};

/* The NS (4 or 8) 16-bit values of one row a lane owns on the CUDA-core value pass, as loaded
 * (two to a word): widened only when used, so that a batch of keys in flight costs NS / 2
 * registers each. */
template <int NS>
struct GpuosAttnRaw {
  static_assert(NS == 4 || NS == 8, "the CUDA-core value pass takes D >= 128");
  unsigned int w[NS / 2];

  /* The values at p (aligned to 2 NS bytes) with one load. */
  __device__ __forceinline__ void load(const char* p) {
    if constexpr (NS == 4) {
      const uint2 u = __ldcg(reinterpret_cast<const uint2*>(p));
      w[0] = u.x, w[1] = u.y;
    } else {
      const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    }
  }
  template <bool BF16>
  __device__ __forceinline__ float at(int e) const {
    const unsigned short h = static_cast<unsigned short>(w[e / 2] >> (16 * (e & 1)));
    return gpuos_16_to_f32<BF16>(h);
  }
};

/* ---- the tensor-core path ------------------------------------------------------------------- */

/* Ask L2 for the key and value rows of the tile at kb (lanes 0-15 keys, 16-31 values), rows at
 * or past k1 skipped: the tile after the current one arrives while this one is computed. The
 * cache's rows, the newest key's too (its own row, new_k's, was just written: in L2). A
 * prefetch of 128-byte lines per lane, not a bulk prefetch: that one takes its address in a
 * uniform register, so a warp's 32 rows cost a loop over the lanes. */
__device__ __forceinline__ void gpuos_attn_prefetch(const GpuosAttnItem& it, int kb, int bytes) {
  const int lane = threadIdx.x % GPUOS_WARP, key = kb + lane % GPUOS_ATTN_TILE;
  if (key >= it.k1) return;
  const GpuosKeys& m = lane < GPUOS_ATTN_TILE ? it.k : it.v;
  const char* row = m.row(key);
  GPUOS_ROLLED
  for (int at = 0; at < bytes; at += 128) gpuos_prefetch_line(row + at);
}

/* Where lane (g, c) reads rows kb + g (lo) and kb + g + 8 (hi) of K or V, at byte 16 c. */
struct GpuosAttnPair {
  const char* lo;
  const char* hi;
};

/* The pair of the tile at kb of m; rows past k1 read row k1 - 1 (valid memory; masked later).
 * `at`: row kb + g's address at byte 16 c, which the scan walks a tile at a time in registers
 * (GpuosKeys::key from the item in shared memory costs ~12 instructions a row): it serves
 * while the tile ends before k1 - 1, where neither the clamp nor the newest key (at n - 1 >=
 * k1 - 1) applies. */
__device__ __forceinline__ GpuosAttnPair gpuos_attn_pair(const GpuosKeys& m, const char* at,
                                                         int kb, int k1) {
  if (kb + GPUOS_ATTN_TILE < k1) return {at, at + 8 * m.lstep};
  const int lane = threadIdx.x % GPUOS_WARP, g = lane >> 2, c = lane & 3;
  return {m.key(min(kb + g, k1 - 1)) + 16 * c, m.key(min(kb + g + 8, k1 - 1)) + 16 * c};
}

/* Row `first` + g's address at byte 16 c of m, the first `at` of gpuos_attn_pair. */
__device__ __forceinline__ const char* gpuos_attn_walk(const GpuosKeys& m, int first) {
  const int lane = threadIdx.x % GPUOS_WARP;
  return m.row(first + (lane >> 2)) + 16 * (lane & 3);
}

/* Lane (g, c)'s 16 bytes at 64 s of its pair's rows (a: lo, b: hi), for the 32-dim steps
 * s = s0 .. s0 + N - 1. K's are the A operand of the scores' products, as linear.cuh loads W;
 * V's are the blocks the value products transpose. */
template <int N>
__device__ __forceinline__ void gpuos_attn_rows(const GpuosAttnPair& r, int s0, uint4 (&a)[N],
                                                uint4 (&b)[N]) {
#pragma unroll
  for (int s = 0; s < N; ++s) {
    a[s] = __ldcg(reinterpret_cast<const uint4*>(r.lo + 64 * (s0 + s)));
    b[s] = __ldcg(reinterpret_cast<const uint4*>(r.hi + 64 * (s0 + s)));
  }
}

/* Scores q . k of the tile whose keys are at `kr`, unscaled, for lane (g, c): c[0], c[1] key g
 * with queries 2c, 2c + 1; c[2], c[3] key g + 8. Keys past k1 are masked later. `qrow`: shared
 * address of this lane's query row g at dims 8c, meaningful for g < NQ (the products' other
 * queries are zeros). */
template <int NS, int NQ, bool BF16>
__device__ __forceinline__ void gpuos_attn_scores(const GpuosAttnPair& kr, unsigned int qrow,
                                                  float (&c)[4]) {
  constexpr int BATCH = NS < 2 ? NS : 2; /* 32-dim steps whose loads are in flight together */
  const int g = (threadIdx.x % GPUOS_WARP) >> 2;
  c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
  for (int s0 = 0; s0 < NS; s0 += BATCH) {
    uint4 a[BATCH], b[BATCH];
    gpuos_attn_rows(kr, s0, a, b);
#pragma unroll
    for (int s = 0; s < BATCH; ++s) {
      const uint4 x = g < NQ ? gpuos_lds16(qrow + 64 * (s0 + s)) : make_uint4(0, 0, 0, 0);
      gpuos_mma16816<BF16>(c, a[s].x, b[s].x, a[s].y, b[s].y, x.x, x.y);
      gpuos_mma16816<BF16>(c, a[s].z, b[s].z, a[s].w, b[s].w, x.z, x.w);
    }
  }
}

/* Max over the 8 lanes g of one c (lanes c, c + 4, ... hold the same queries). */
__device__ __forceinline__ float gpuos_attn_max8(float v) {
#pragma unroll
  for (int o = 4; o < GPUOS_WARP; o <<= 1) v = fmaxf(v, __shfl_xor_sync(GPUOS_ALL_LANES, v, o));
  return v;
}

__device__ __forceinline__ float gpuos_attn_sum8(float v) {
#pragma unroll
  for (int o = 4; o < GPUOS_WARP; o <<= 1) v += __shfl_xor_sync(GPUOS_ALL_LANES, v, o);
  return v;
}

/* Keys whose values a lane has in flight at once on the CUDA-core value pass: GPUOS_ATTN_VBATCH,
 * half that for D = 256. */
template <int NS>
__device__ __forceinline__ constexpr int gpuos_attn_vb() {
  return NS < 8 ? GPUOS_ATTN_VBATCH : GPUOS_ATTN_VBATCH / 2;
}

/* This lane's dims of the values of keys kb .. kb + VB - 1 (row k1 - 1 past k1). */
template <int NS, int VB>
__device__ __forceinline__ void gpuos_attn_load_values(const GpuosAttnItem& it, int kb,
                                                       GpuosAttnRaw<NS> (&raw)[VB]) {
  const int ofs = 2 * NS * (threadIdx.x % GPUOS_WARP);
#pragma unroll
  for (int u = 0; u < VB; ++u) raw[u].load(it.v.key(min(kb + u, it.k1 - 1)) + ofs);
}

/* acc = acc * alpha + p^T V over the tile at kb on CUDA cores (D >= 128), from its
 * probabilities in shared memory (zero past k1), gpuos_attn_vb keys' loads in flight at once;
 * `raw` holds the first batch, loaded by the caller after the tile's scores. */
template <int NS, int NQ, bool BF16, int VB>
__device__ __forceinline__ void gpuos_attn_values(const GpuosAttnItem& it, int kb,
                                                  const float (&p)[GPUOS_ATTN_TILE][GPUOS_ATTN_MAX_Q],
                                                  const float* alpha, GpuosAttnAcc<NQ, NS>& acc,
                                                  GpuosAttnRaw<NS> (&raw)[VB]) {
#pragma unroll
  for (int j = 0; j < NQ; ++j) {
    const float a = alpha[j];
#pragma unroll
    for (int e = 0; e < NS; ++e) acc.v[j][e] *= a;
  }
#pragma unroll
  for (int k0 = 0; k0 < GPUOS_ATTN_TILE; k0 += VB) {
    if (k0 > 0) gpuos_attn_load_values(it, kb + k0, raw);
#pragma unroll
    for (int u = 0; u < VB; ++u) {
      float pk[NQ];
#pragma unroll
      for (int j = 0; j < NQ; ++j) pk[j] = p[k0 + u][j];
#pragma unroll
      for (int e = 0; e < NS; ++e) {
        const float x = raw[u].template at<BF16>(e);
#pragma unroll
        for (int j = 0; j < NQ; ++j) acc.v[j][e] += pk[j] * x;
      }
    }
  }
}

/* The 8 x 8 matrix of 16-bit values whose row g, columns 2c and 2c + 1 lane (g, c) holds in v,
 * transposed: lane (g, c) gets row g, columns 2c and 2c + 1 of the transpose. */
__device__ __forceinline__ unsigned int gpuos_attn_trans(unsigned int v) {
  unsigned int t;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(v));
  return t;
}

/* The dim of row g of a value product's fragment, for 32-dim step s and word w (0 .. 3) of the
 * lanes' 16-byte loads: block (s, w) holds dims 32 s + 8 c + 2 w, + 1 in lane (g, c), so row g
 * of its transpose is column pair g / 2, element g % 2. */
__device__ __forceinline__ int gpuos_attn_tc_dim(int s, int w, int g) {
  return 32 * s + 8 * (g >> 1) + 2 * w + (g & 1);
}

/* o += V^T P^T over one tile: o[2 s + h] is the product of rows (dims) gpuos_attn_tc_dim(s, 2 h, g)
 * (o[.][0], o[.][1]: queries 2c, 2c + 1) and gpuos_attn_tc_dim(s, 2 h + 1, g) (o[.][2], o[.][3]);
 * lo, hi: V's rows (gpuos_attn_rows), b0, b1: this lane's probabilities of queries g for keys
 * 2c, 2c + 1 and 2c + 8, 2c + 9. */
template <int NS, bool BF16>
__device__ __forceinline__ void gpuos_attn_values_tc(const uint4 (&lo)[NS], const uint4 (&hi)[NS],
                                                     unsigned int b0, unsigned int b1,
                                                     float (&o)[2 * NS][4]) {
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    const unsigned int a[4] = {lo[s].x, lo[s].y, lo[s].z, lo[s].w};
    const unsigned int b[4] = {hi[s].x, hi[s].y, hi[s].z, hi[s].w};
#pragma unroll
    for (int h = 0; h < 2; ++h)
      gpuos_mma16816<BF16>(o[2 * s + h], gpuos_attn_trans(a[2 * h]),
                           gpuos_attn_trans(a[2 * h + 1]), gpuos_attn_trans(b[2 * h]),
                           gpuos_attn_trans(b[2 * h + 1]), b0, b1);
  }
}

/* Warp w's outputs [query][dim], fp32, between its scan and the store: its GPUOS_ATTN_OUT_SMEM
 * bytes of gpuos_dynamic_smem, after the staging areas. */
__device__ __forceinline__ float* gpuos_attn_area(int w) {
  return reinterpret_cast<float*>(gpuos_dynamic_smem + GPUOS_ATTN_WARPS * GPUOS_ATTN_WARP_SMEM) +
         w * (GPUOS_ATTN_OUT_SMEM / 4);
}

/* The value products' outputs into `area` [query][dim]. */
template <int NS, int NQ>
__device__ __forceinline__ void gpuos_attn_tc_area(const float (&o)[2 * NS][4], float* area) {
  const int lane = threadIdx.x % GPUOS_WARP, g = lane >> 2, c = lane & 3;
  constexpr int D = GPUOS_WARP * NS;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
#pragma unroll
    for (int r = 0; r < 8; ++r) { /* fragment 2 s + r / 4, element r % 4 */
      const int j = 2 * c + (r & 1), w = 2 * (r / 4) + ((r >> 1) & 1);
      if (j < NQ) area[j * D + gpuos_attn_tc_dim(s, w, g)] = o[2 * s + r / 4][r % 4];
    }
  }
}

/* This warp's tiles of the item on tensor cores, at keys first, first + step, ... (step: 16 in
 * warp mode, 128 in block mode) over queries staged at shared address `qs`; its outputs, not yet
 * divided by the sums, into its area (gpuos_attn_area) and its maxima and sums per query
 * published. The rows GPUOS_ATTN_ALIGN keys ahead are asked of L2 as it goes. */
template <int NS, int NQ, bool BF16>
__device__ __forceinline__ void gpuos_attn_scan_mma(const GpuosTask* t, const GpuosAttnPlan& p,
                                                    const GpuosAttnItem& it, GpuosAttnShared& sh,
                                                    int first, int step, unsigned int qs) {
  /* The value pass on tensor cores for D <= 64; at D = 128 its 32 accumulators and 32 registers
   * of values spill (H200: 9% slower than on CUDA cores at 64 requests, 32% with grouped heads) */
  constexpr bool TC = NS <= 2;
  const int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  const int g = lane >> 2, c = lane & 3, bytes = 2 * p.d;
  /* scores in base-2 units (scale log2(e)), so that each exponential is one ex2 */
  const float scale = t->scalars[0] * GPUOS_LOG2E, none = gpuos_neg_inf();
  const unsigned int qrow = qs + g * gpuos_attn_qpitch(p.d) + 16 * c;
  float (&prob)[GPUOS_ATTN_TILE][GPUOS_ATTN_MAX_Q] = sh.tile[warp].p;
  GpuosAttnAcc<NQ, NS> acc; /* else: the CUDA-core value pass's accumulators */
  acc.zero();
  float m0 = none, m1 = none, l0 = 0.0f, l1 = 0.0f; /* queries 2c and 2c + 1 */
  const int lim0 = gpuos_attn_limit(p, it, 2 * c), lim1 = gpuos_attn_limit(p, it, 2 * c + 1);
  float o[2 * NS][4] = {};                           /* TC: the value products' fragments */
  GPUOS_ROLLED
  for (int kb = first; kb < first + GPUOS_ATTN_ALIGN; kb += step)
    gpuos_attn_prefetch(it, kb, bytes);
  const char *kat = gpuos_attn_walk(it.k, first), *vat = gpuos_attn_walk(it.v, first);
  GPUOS_ROLLED
  for (int kb = first; kb < it.k1; kb += step) {
    gpuos_attn_prefetch(it, kb + GPUOS_ATTN_ALIGN, bytes);
    /* TC: the values travel with the keys; else their first batch comes after the scores */
    uint4 vlo[NS], vhi[NS];                    /* TC */
    GpuosAttnRaw<TC ? 4 : NS> raw[gpuos_attn_vb<NS>()]; /* else (TC: unused) */
    if (TC) gpuos_attn_rows(gpuos_attn_pair(it.v, vat, kb, it.k1), 0, vlo, vhi);
    float s[4];
    gpuos_attn_scores<NS, NQ, BF16>(gpuos_attn_pair(it.k, kat, kb, it.k1), qrow, s);
    kat += step * it.k.lstep, vat += step * it.v.lstep;
    if (!TC) gpuos_attn_load_values(it, kb, raw);
    const int key0 = kb + g, key1 = kb + g + 8;
    s[0] = key0 < lim0 ? scale * s[0] : none, s[1] = key0 < lim1 ? scale * s[1] : none;
    s[2] = key1 < lim0 ? scale * s[2] : none, s[3] = key1 < lim1 ? scale * s[3] : none;
    const float n0 = fmaxf(m0, gpuos_attn_max8(fmaxf(s[0], s[2])));
    const float n1 = fmaxf(m1, gpuos_attn_max8(fmaxf(s[1], s[3])));
    /* Exponentials against a finite reference: n, or 0 for a query that has seen no key yet
     * (ragged plans), so that -inf - r is -inf and 2^-inf 0, never NaN */
    const float r0 = n0 == none ? 0.0f : n0, r1 = n1 == none ? 0.0f : n1;
    const float a0 = gpuos_exp2(m0 - r0), a1 = gpuos_exp2(m1 - r1);
    const float p0 = gpuos_exp2(s[0] - r0), p1 = gpuos_exp2(s[1] - r1);
    const float p2 = gpuos_exp2(s[2] - r0), p3 = gpuos_exp2(s[3] - r1);
    l0 = l0 * a0 + p0 + p2, l1 = l1 * a1 + p1 + p3, m0 = n0, m1 = n1;
    if constexpr (TC) {
#pragma unroll
      for (int f = 0; f < 2 * NS; ++f) o[f][0] *= a0, o[f][1] *= a1, o[f][2] *= a0, o[f][3] *= a1;
      /* lane (g, c) holds keys g and g + 8 of queries 2c, 2c + 1: transposed, B's queries g */
      const int dt = BF16 ? GPUOS_DTYPE_BF16 : GPUOS_DTYPE_F16;
      const unsigned int b0 = gpuos_attn_trans(gpuos_f32x2_to_16(dt, p0, p1));
      const unsigned int b1 = gpuos_attn_trans(gpuos_f32x2_to_16(dt, p2, p3));
      gpuos_attn_values_tc<NS, BF16>(vlo, vhi, b0, b1, o);
    } else {
      *reinterpret_cast<float2*>(&prob[g][2 * c]) = make_float2(p0, p1);
      *reinterpret_cast<float2*>(&prob[g + 8][2 * c]) = make_float2(p2, p3);
      if (g == 0) *reinterpret_cast<float2*>(&sh.tile[warp].alpha[2 * c]) = make_float2(a0, a1);
      __syncwarp();
      gpuos_attn_values<NS, NQ, BF16>(it, kb, prob, sh.tile[warp].alpha, acc, raw);
      __syncwarp(); /* every lane read the tile's probabilities before the next overwrites them */
    }
  }
  float* area = gpuos_attn_area(warp);
  if constexpr (TC) {
    gpuos_attn_tc_area<NS, NQ>(o, area);
  } else {
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
#pragma unroll
      for (int e = 0; e < NS; ++e) area[j * GPUOS_WARP * NS + NS * lane + e] = acc.v[j][e];
    }
  }
  l0 = gpuos_attn_sum8(l0), l1 = gpuos_attn_sum8(l1);
  m0 *= GPUOS_LN2, m1 *= GPUOS_LN2; /* the maxima published in natural units */
  if (g == 0 && 2 * c < NQ) sh.m[warp][2 * c] = m0, sh.l[warp][2 * c] = l0;
  if (g == 0 && 2 * c + 1 < NQ) sh.m[warp][2 * c + 1] = m1, sh.l[warp][2 * c + 1] = l1;
}

/* ---- the CUDA-core path --------------------------------------------------------------------- */

/* This warp's keys warp, warp + W, ... of the item, one at a time: lane i loads dims NS i + e of
 * the key and the value (lanes past D load dim 0 and drop it), a warp sum per query gives its
 * score. Queries are fp32, scaled, in shared memory [query][dim]. */
template <int NS, int NQ>
__device__ __forceinline__ void gpuos_attn_scan_generic(const GpuosAttnPlan& p,
                                                        const GpuosAttnItem& it,
                                                        GpuosAttnShared& sh,
                                                        GpuosAttnAcc<NQ, NS>& acc) {
  const int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  const int64_t kofs = NS * lane * it.k.dstep, vofs = NS * lane * it.v.dstep;
  float m[NQ], l[NQ];
  int lim[NQ];
#pragma unroll
  for (int j = 0; j < NQ; ++j) {
    m[j] = gpuos_neg_inf(), l[j] = 0.0f;
    lim[j] = gpuos_attn_limit(p, it, j);
  }
  GPUOS_ROLLED
  for (int key = it.k0 + warp; key < it.k1; key += GPUOS_ATTN_WARPS) {
    const char *kr = it.k.key(key), *vr = it.v.key(key);
    float kv[NS], vv[NS];
#pragma unroll
    for (int e = 0; e < NS; ++e) {
      const bool in = NS * lane + e < p.d;
      kv[e] = gpuos_load_ptr(in ? kr + kofs + e * it.k.dstep : kr, it.k.dtype);
      vv[e] = gpuos_load_ptr(in ? vr + vofs + e * it.v.dstep : vr, it.v.dtype);
    }
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      if (key >= lim[j]) continue; /* warp-uniform */
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < NS; ++e) {
        const int d = NS * lane + e;
        dot += d < p.d ? sh.q[j * p.d + d] * kv[e] : 0.0f;
      }
      dot = gpuos_warp_sum(dot);
      const float m_new = fmaxf(m[j], dot), alpha = gpuos_exp_diff(m[j], m_new);
      const float pj = gpuos_exp_diff(dot, m_new);
      l[j] = l[j] * alpha + pj, m[j] = m_new;
#pragma unroll
      for (int e = 0; e < NS; ++e) acc.v[j][e] = acc.v[j][e] * alpha + pj * vv[e];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < NQ; ++j) sh.m[warp][j] = m[j], sh.l[warp][j] = l[j];
  }
}

/* ---- merge, partials and the combine -------------------------------------------------------- */

/* The warps' states into shared mall, lall and o (rescaled to the common max, summed in warp
 * order), for the item's nq queries, on the CUDA-core path: the warps add into o one after
 * another, a barrier each. All threads call; only the first `warps` warps saw keys (the others'
 * states are empty: -inf max, zero sum and outputs, so leaving them out changes no bit). */
template <int NS, int NQ>
__device__ __forceinline__ void gpuos_attn_merge(const GpuosAttnPlan& p, GpuosAttnShared& sh,
                                                 const GpuosAttnAcc<NQ, NS>& acc, int nq,
                                                 int warps) {
  const int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  __syncthreads(); /* states published; tiles done (o overlays them) */
  if (threadIdx.x < nq) {
    const int j = threadIdx.x;
    float m = gpuos_neg_inf(), l = 0.0f;
    GPUOS_ROLLED
    for (int w = 0; w < warps; ++w) m = fmaxf(m, sh.m[w][j]);
    GPUOS_ROLLED
    for (int w = 0; w < warps; ++w) l += sh.l[w][j] * gpuos_exp_diff(sh.m[w][j], m);
    sh.mall[j] = m, sh.lall[j] = l;
  }
  __syncthreads();
  GPUOS_ROLLED
  for (int w = 0; w < warps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int j = 0; j < NQ; ++j) {
        if (j >= nq) break;
        const float f = gpuos_exp_diff(sh.m[w][j], sh.mall[j]);
#pragma unroll
        for (int e = 0; e < NS; ++e) {
          const int d = NS * lane + e, i = j * p.d + d;
          if (d < p.d) sh.o[i] = (w == 0 ? 0.0f : sh.o[i]) + acc.v[j][e] * f;
        }
      }
    }
    __syncthreads();
  }
}


/* Element offset in out of the item's row j, dim d. */
__device__ __forceinline__ int64_t gpuos_attn_out_at(const GpuosTask* t, const GpuosAttnItem& it,
                                                     int j, int d) {
  return it.out[j] + d * t->out.strides[t->out.ndim - 1];
}

/* Store value f(j, d) of each of the item's rows j and dims d into out, by the threads first,
 * first + stride, ...; D: the rows' length where the caller knows it at compile time (the
 * tensor-core path's 32 NS), else 0 (p.d). */
template <int D = 0, class F>
__device__ __forceinline__ void gpuos_attn_store(const GpuosTask* t, const GpuosAttnPlan& p,
                                                 const GpuosAttnItem& it, int first, int stride,
                                                 F f) {
  const int dims = D > 0 ? D : p.d;
  GPUOS_ROLLED
  for (int i = first; i < it.nq * dims; i += stride) {
    const int j = i / dims, d = i % dims;
    gpuos_store(t->out, gpuos_attn_out_at(t, it, j, d), f(j, d));
  }
}

/* Split s of the item's group: NQ maxima, NQ sums, then NQ x D outputs, fp32. */
__device__ __forceinline__ float* gpuos_attn_part(const GpuosAttnPlan& p, const GpuosAttnItem& it,
                                                  int s) {
  return p.parts + (static_cast<int64_t>(it.group) * p.splits + s) * p.nq * (p.d + 2);
}

/* The group's outputs from its A partials, rescaled to their common max and summed in split
 * order (GPUOS_ILP splits' loads in flight at a time), by the threads first, first + stride, ... */
__device__ __forceinline__ void gpuos_attn_combine(const GpuosTask* t, const GpuosAttnPlan& p,
                                                   const GpuosAttnItem& it, int first, int stride) {
  gpuos_attn_store(t, p, it, first, stride, [&](int j, int d) {
    float m = gpuos_neg_inf(), num = 0.0f, den = 0.0f;
    GPUOS_ROLLED
    for (int s0 = 0; s0 < it.active; s0 += GPUOS_ILP) {
      float ms[GPUOS_ILP];
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) {
        const bool in = s0 + u < it.active;
        ms[u] = in ? __ldcg(gpuos_attn_part(p, it, s0 + u) + j) : gpuos_neg_inf();
      }
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) m = fmaxf(m, ms[u]);
    }
    GPUOS_ROLLED
    for (int s0 = 0; s0 < it.active; s0 += GPUOS_ILP) {
      float ms[GPUOS_ILP], ls[GPUOS_ILP], os[GPUOS_ILP];
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) {
        const float* part = gpuos_attn_part(p, it, min(s0 + u, it.active - 1));
        ms[u] = __ldcg(part + j), ls[u] = __ldcg(part + p.nq + j);
        os[u] = __ldcg(part + 2 * p.nq + j * p.d + d);
      }
#pragma unroll
      for (int u = 0; u < GPUOS_ILP; ++u) {
        if (s0 + u >= it.active) break;
        const float f = gpuos_exp_diff(ms[u], m);
        den += ls[u] * f, num += os[u] * f;
      }
    }
    return gpuos_attn_ratio(num, den);
  });
}

/* Counts the item's split in on its group's counter: whether this arrival completes the group.
 * One thread calls, after the barrier behind every thread that wrote the partial
 * (gpuos_count_in). */
__device__ __forceinline__ bool gpuos_attn_completes(const GpuosAttnPlan& p,
                                                     const GpuosAttnItem& it) {
  return gpuos_count_in(p.counters + it.group, static_cast<unsigned int>(it.active - 1));
}

/* After the item's partial is stored: counts it in on its group's counter, and the block that
 * completes the group combines it. All threads call. */
__device__ __forceinline__ void gpuos_attn_count_in(const GpuosTask* t, const GpuosAttnPlan& p,
                                                    const GpuosAttnItem& it, GpuosAttnShared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) sh.last = gpuos_attn_completes(p, it);
  __syncthreads();
  if (sh.last) gpuos_attn_combine(t, p, it, threadIdx.x, blockDim.x);
}

/* The merged item (gpuos_attn_merge): out when it is the group's only split, else its partial,
 * counted in. All threads call. */
__device__ __forceinline__ void gpuos_attn_emit(const GpuosTask* t, const GpuosAttnPlan& p,
                                                const GpuosAttnItem& it, GpuosAttnShared& sh) {
  if (it.active == 1) {
    gpuos_attn_store(t, p, it, threadIdx.x, blockDim.x,
                     [&](int j, int d) { return gpuos_attn_ratio(sh.o[j * p.d + d], sh.lall[j]); });
    return;
  }
  float* part = gpuos_attn_part(p, it, it.split);
  GPUOS_ROLLED
  for (int i = threadIdx.x; i < it.nq * p.d; i += blockDim.x) part[2 * p.nq + i] = sh.o[i];
  if (threadIdx.x < it.nq) part[threadIdx.x] = sh.mall[threadIdx.x];
  if (threadIdx.x < it.nq) part[p.nq + threadIdx.x] = sh.lall[threadIdx.x];
  gpuos_attn_count_in(t, p, it, sh);
}

/* The tensor-core path's merge and emit in one pass: each thread takes outputs (j, d) and sums
 * them over the first `warps` warps' areas (gpuos_attn_scan_mma) in warp order, rescaled to
 * their common max, with the sums likewise; then out, or the partial counted in. One barrier
 * where a merge through shared o took four (H200, one row: 2.3 us from the scan to the store's
 * end). All threads call. */
template <int NS>
__device__ __forceinline__ void gpuos_attn_gather(const GpuosTask* t, const GpuosAttnPlan& p,
                                                  const GpuosAttnItem& it, GpuosAttnShared& sh,
                                                  int warps) {
  constexpr int D = GPUOS_WARP * NS; /* the tensor-core path's D */
  __syncthreads(); /* the warps' areas, maxima and sums */
  float* part = it.active == 1 ? nullptr : gpuos_attn_part(p, it, it.split);
  GPUOS_ROLLED
  for (int i = threadIdx.x; i < it.nq * D; i += blockDim.x) {
    const int j = i / D, d = i % D;
    float m = gpuos_neg_inf(), l = 0.0f, o = 0.0f;
    GPUOS_ROLLED
    for (int w = 0; w < warps; ++w) m = fmaxf(m, sh.m[w][j]);
    GPUOS_ROLLED
    for (int w = 0; w < warps; ++w) {
      const float f = gpuos_exp_diff(sh.m[w][j], m);
      l += sh.l[w][j] * f, o += gpuos_attn_area(w)[i] * f;
    }
    if (part == nullptr) {
      gpuos_store(t->out, gpuos_attn_out_at(t, it, j, d), gpuos_attn_ratio(o, l));
    } else {
      part[2 * p.nq + i] = o;
      if (d == 0) part[j] = m, part[p.nq + j] = l;
    }
  }
  if (part != nullptr) gpuos_attn_count_in(t, p, it, sh);
}

/* ---- the operator --------------------------------------------------------------------------- */

/* Whether an item has work: keys in its split, or split 0 of a row with none (it writes zeros). */
__device__ __forceinline__ bool gpuos_attn_busy(const GpuosAttnItem& it) {
  return it.split < it.active || (it.active == 0 && it.split == 0);
}

/* Whether the record's lengths are settled (the host's: no producer in the program writes
 * them): then the items it decodes before its wait are the ones it runs (gpuos_attn_warm), and
 * the round trips that read their lengths are off its path. */
__device__ __forceinline__ bool gpuos_attn_known(const GpuosTask* t) { return gpuos_settled(t, 3); }

/* Warp mode: whether warp `warp` (< GPUOS_ATTN_WARPS) has its first item in its staging area
 * before the wait: it has one among the record's first 32 (`round0`, their ballot) and the
 * lengths are known. gpuos_attn_warm stages it; gpuos_attn_warp_items runs it. */
__device__ __forceinline__ bool gpuos_attn_staged(const GpuosTask* t, unsigned int round0,
                                                  int warp) {
  return __popc(round0) > warp && gpuos_attn_known(t);
}

/* Block mode: the record's items one after another, with NS output dims per lane; MODE 0: CUDA
 * cores, 1: fp16 and 2: bf16 on tensor cores. Where the lengths are known, the first item is in
 * sh.item already (gpuos_attn_warm). */
template <int NS, int MODE>
__device__ __forceinline__ void gpuos_attn_items(const GpuosTask* t, GpuosAttnShared& sh) {
  constexpr int NQ = gpuos_attn_nq(NS);
  const GpuosAttnPlan& p = sh.plan;
  const bool scans = threadIdx.x < GPUOS_ATTN_WARPS * GPUOS_WARP;
  const int warp = threadIdx.x / GPUOS_WARP;
  const GpuosAttnItem& it = sh.item;
  GPUOS_ROLLED
  for (int64_t i = t->range_begin; i < t->range_end; ++i) {
    __syncthreads(); /* the previous item's readers of item, q, o and last are done */
    const bool decoded = i == t->range_begin && gpuos_attn_known(t); /* gpuos_attn_warm's */
    if (threadIdx.x == 0 && !decoded) sh.item = gpuos_attn_item(t, p, i);
    __syncthreads();
    GPUOS_MARK(1);
    if (!p.ragged && !gpuos_attn_busy(it)) continue; /* else its length is its rows' longest */
    if (!decoded) {
      gpuos_attn_rows_of(t, p, sh.item, threadIdx.x, blockDim.x);
      __syncthreads();
    }
    if (!gpuos_attn_busy(it)) continue;
    if (it.active == 0) {
      gpuos_attn_store(t, p, it, threadIdx.x, blockDim.x, [](int, int) { return 0.0f; });
      continue;
    }
    gpuos_attn_stage_q<NQ>(t, p, it, sh.q, threadIdx.x, blockDim.x);
    __syncthreads();
    GPUOS_MARK(2);
    const int step = MODE == 0 ? 1 : GPUOS_ATTN_TILE; /* keys a warp takes at a time */
    const int warps = min(GPUOS_ATTN_WARPS, (it.k1 - it.k0 + step - 1) / step);
    if constexpr (MODE == 0) {
      GpuosAttnAcc<NQ, NS> acc;
      acc.zero();
      if (scans) gpuos_attn_scan_generic<NS, NQ>(p, it, sh, acc);
      GPUOS_MARK(3);
      gpuos_attn_merge<NS, NQ>(p, sh, acc, it.nq, warps);
      gpuos_attn_emit(t, p, it, sh);
    } else {
      const int first = it.k0 + GPUOS_ATTN_TILE * warp;
      if (scans && first < it.k1)
        gpuos_attn_scan_mma<NS, NQ, MODE == 2>(t, p, it, sh, first, GPUOS_ATTN_ALIGN,
                                               gpuos_smem_address(sh.q));
      GPUOS_MARK(3);
      gpuos_attn_gather<NS>(t, p, it, sh, warps);
    }
    GPUOS_MARK(4);
  }
}

/* Position of set bit k (counted from 0) of mask. */
__device__ __forceinline__ int gpuos_nth_bit(unsigned int mask, int k) {
  GPUOS_ROLLED
  for (int s = 0; s < k; ++s) mask &= mask - 1;
  return __ffs(mask) - 1;
}

/* Whether item i has work, from the lengths as they are: every item where the keys are one
 * split (its split 0 has keys, or writes its rows' zeros); else in ragged plans from its rows'
 * longest, each row's length found by a walk of its own (unrolled: their loads in flight
 * together), where an item that is not busy would cost its warp a decode and a walk of its rows
 * (the splits past a chunk's prompt, in slots of many keys). The walks cost a record ~3 us before
 * its wait (H200, s261). */
__device__ __forceinline__ bool gpuos_attn_busy_at(const GpuosTask* t, const GpuosAttnPlan& p,
                                                   int64_t i) {
  if (p.splits == 1) return true;
  GpuosAttnItem it = gpuos_attn_item(t, p, i, false);
  if (p.ragged) {
    int n = it.n[0];
#pragma unroll
    for (int j = 1; j < GPUOS_ATTN_MAX_Q; ++j) {
      GpuosRow len = gpuos_vector(t->in[3]);
      gpuos_seek(t->in[0], p.lead, it.row0 + min(j, it.nq - 1), len);
      n = max(n, min(gpuos_load_i32(len.p), p.keys));
    }
    gpuos_attn_span(p, it, n);
  }
  return gpuos_attn_busy(it);
}

/* The busy items among the record's items r0 .. r0 + 31 (lane i decodes item r0 + i), as a
 * ballot. Warp-uniform. */
__device__ __forceinline__ unsigned int gpuos_attn_busy_round(const GpuosTask* t,
                                                             const GpuosAttnPlan& p, int64_t r0) {
  const int64_t i = r0 + threadIdx.x % GPUOS_WARP;
  return __ballot_sync(GPUOS_ALL_LANES, i < t->range_end && gpuos_attn_busy_at(t, p, i));
}

/* Warp mode's deal: f(i) for each item of the record that has work and falls to this warp, in
 * order, while f returns true. The lanes decode 32 items at a time (gpuos_attn_busy_round; the
 * first 32 are sh.round0 where the lengths are known), and the busy ones go to the warps in
 * turn. Warp-uniform; warps past GPUOS_ATTN_WARPS get none. */
template <class F>
__device__ __forceinline__ void gpuos_attn_deal(const GpuosTask* t, const GpuosAttnShared& sh,
                                                F f) {
  const int warp = threadIdx.x / GPUOS_WARP;
  if (warp >= GPUOS_ATTN_WARPS) return;
  int next = warp; /* this warp's next rank among the record's busy items */
  int seen = 0;    /* busy items in the rounds so far */
  GPUOS_ROLLED
  for (int64_t r0 = t->range_begin; r0 < t->range_end; r0 += GPUOS_WARP) {
    const bool given = r0 == t->range_begin && gpuos_attn_known(t);
    const unsigned int mask = given ? sh.round0[warp] : gpuos_attn_busy_round(t, sh.plan, r0);
    const int before = seen;
    seen += __popc(mask);
    for (; next < seen; next += GPUOS_ATTN_WARPS)
      if (!f(r0 + gpuos_nth_bit(mask, next - before))) return;
  }
}

/* Warp mode: item i by this warp alone, its item and queries in the warp's staging area (the
 * item there already where `decoded`: gpuos_attn_warm); the outputs, or its partial counted in
 * (the warp that completes the group combines it). */
template <int NS, bool BF16>
__device__ __forceinline__ void gpuos_attn_warp_item(const GpuosTask* t, const GpuosAttnPlan& p,
                                                     GpuosAttnShared& sh, int64_t i, char* area,
                                                     bool decoded) {
  constexpr int NQ = gpuos_attn_nq(NS);
  const int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  GpuosAttnItem& it = *reinterpret_cast<GpuosAttnItem*>(area);
  float* qs = reinterpret_cast<float*>(area + GPUOS_ATTN_WARP_Q);
  constexpr int D = GPUOS_WARP * NS; /* the tensor-core path's D */
  __syncwarp(); /* the previous item's readers of the area are done */
  if (lane == 0 && !decoded) it = gpuos_attn_item(t, p, i);
  __syncwarp();
  if (!decoded) { /* else gpuos_attn_warm's */
    gpuos_attn_rows_of(t, p, it, lane, GPUOS_WARP);
    __syncwarp();
  }
  GPUOS_MARK(1); /* marks: warp 0's last item */
  if (it.active == 0) {
    gpuos_attn_store(t, p, it, lane, GPUOS_WARP, [](int, int) { return 0.0f; });
    return;
  }
  gpuos_attn_stage_q<NQ>(t, p, it, qs, lane, GPUOS_WARP);
  __syncwarp();
  GPUOS_MARK(2);
  gpuos_attn_scan_mma<NS, NQ, BF16>(t, p, it, sh, it.k0, GPUOS_ATTN_TILE, gpuos_smem_address(qs));
  __syncwarp(); /* its outputs, maxima and sums are published */
  GPUOS_MARK(3);
  const float *m = sh.m[warp], *l = sh.l[warp], *o = gpuos_attn_area(warp);
  if (it.active == 1) {
    gpuos_attn_store<D>(t, p, it, lane, GPUOS_WARP,
                        [&](int j, int d) { return gpuos_attn_ratio(o[j * D + d], l[j]); });
    GPUOS_MARK(4);
    return;
  }
  float* part = gpuos_attn_part(p, it, it.split);
  GPUOS_ROLLED
  for (int i = lane; i < it.nq * D; i += GPUOS_WARP) part[2 * p.nq + i] = o[i];
  GPUOS_MARK(4);
  if (lane < it.nq) part[lane] = m[lane], part[p.nq + lane] = l[lane];
  __syncwarp();
  const int last = lane == 0 && gpuos_attn_completes(p, it);
  if (__shfl_sync(GPUOS_ALL_LANES, last, 0)) {
    __syncwarp(); /* orders every lane's reads after lane 0's acquire */
    gpuos_attn_combine(t, p, it, lane, GPUOS_WARP);
  }
}

/* Where the lengths are known, a warp whose first item is among the record's first 32 has it in
 * its staging area already (gpuos_attn_warm). */
template <int NS, bool BF16>
__device__ __forceinline__ void gpuos_attn_warp_items(const GpuosTask* t, GpuosAttnShared& sh) {
  const int warp = threadIdx.x / GPUOS_WARP;
  char* area = gpuos_dynamic_smem + GPUOS_ATTN_WARP_SMEM * warp;
  bool decoded = warp < GPUOS_ATTN_WARPS && gpuos_attn_staged(t, sh.round0[warp], warp);
  gpuos_attn_deal(t, sh, [&](int64_t i) {
    gpuos_attn_warp_item<NS, BF16>(t, sh.plan, sh, i, area, decoded);
    decoded = false;
    return true;
  });
}

template <int NS>
__device__ __forceinline__ void gpuos_attn_mode(const GpuosTask* t, GpuosAttnShared& sh) {
  const bool bf16 = t->in[0].dtype == GPUOS_DTYPE_BF16;
  if (!sh.plan.fast) {
    gpuos_attn_items<NS, 0>(t, sh);
  } else if (sh.plan.warps) {
    if (bf16) gpuos_attn_warp_items<NS, true>(t, sh);
    else gpuos_attn_warp_items<NS, false>(t, sh);
  } else if (bf16) {
    gpuos_attn_items<NS, 2>(t, sh);
  } else {
    gpuos_attn_items<NS, 1>(t, sh);
  }
}

/* Ask L2 for the key and value rows [k0, k0 + keys) of an item, a line per thread first,
 * first + stride, ... at a time. */
__device__ __forceinline__ void gpuos_attn_warm_item(const GpuosTask* t, const GpuosAttnPlan& p,
                                                     const GpuosAttnItem& it, int keys, int first,
                                                     int stride) {
  const int row_lines = (p.d * gpuos_dtype_size(t->in[1].dtype) + 127) / 128;
  const int lines = 2 * keys * row_lines;
  GPUOS_ROLLED
  for (int i = first; i < lines; i += stride) {
    const int key = it.k0 + i / (2 * row_lines), part = i % (2 * row_lines);
    /* the rows chosen by value: a reference to it.k or it.v would keep the item in memory */
    const char* row = part < row_lines ? it.k.key(key) : it.v.key(key);
    gpuos_prefetch_line(row + 128 * (part % row_lines));
  }
}

/* Before the queries are ready (GPUOS_TASK_EARLY): what the record can learn of its items, and
 * L2 asked for the keys and values it starts with (the first item's in block mode, each warp's
 * first GPUOS_ATTN_ALIGN in warp mode). Items are decoded from the lengths as they are now:
 * where they are known (gpuos_attn_known), the first item goes to sh.item (block mode) or the
 * warp's staging area (warp mode, with the first 32 items' ballot in sh.round0), else what a
 * producer may still rewrite is only a hint, whose rows are bounded by K's and V's own sizes.
 * All threads call. */
__device__ __forceinline__ void gpuos_attn_warm(const GpuosTask* t, GpuosAttnShared& sh) {
  const GpuosAttnPlan& p = sh.plan;
  const bool known = gpuos_attn_known(t);
  if (!p.warps) {
    const GpuosAttnItem it = gpuos_attn_item(t, p, t->range_begin, known);
    if (known && threadIdx.x == 0) sh.item = it;
    if (known) { /* uniform */
      __syncthreads();
      gpuos_attn_rows_of(t, p, sh.item, threadIdx.x, blockDim.x);
    }
    if (p.fast) gpuos_attn_warm_item(t, p, it, it.k1 - it.k0, threadIdx.x, blockDim.x);
    return;
  }
  const int warp = threadIdx.x / GPUOS_WARP;
  if (warp >= GPUOS_ATTN_WARPS) return;
  const unsigned int round0 = gpuos_attn_busy_round(t, p, t->range_begin);
  sh.round0[warp] = round0; /* by every lane, so each reads its own store */
  if (__popc(round0) <= warp) return;
  const int64_t i = t->range_begin + gpuos_nth_bit(round0, warp);
  const GpuosAttnItem it = gpuos_attn_item(t, p, i, known);
  if (gpuos_attn_staged(t, round0, warp)) {
    GpuosAttnItem& staged = *reinterpret_cast<GpuosAttnItem*>(gpuos_dynamic_smem +
                                                              GPUOS_ATTN_WARP_SMEM * warp);
    if (threadIdx.x % GPUOS_WARP == 0) staged = it;
    __syncwarp();
    gpuos_attn_rows_of(t, p, staged, threadIdx.x % GPUOS_WARP, GPUOS_WARP);
  }
  const int keys = min(it.k1 - it.k0, GPUOS_ATTN_ALIGN);
  gpuos_attn_warm_item(t, p, it, max(keys, 0), threadIdx.x % GPUOS_WARP, GPUOS_WARP);
}

__device__ __forceinline__ void gpuos_attention_decode(const GpuosTask* t) {
  __shared__ __align__(16) GpuosAttnShared sh;
  if (t->range_begin >= t->range_end) { /* no rows: uniform */
    gpuos_await(t);
    return;
  }
  /* GPUOS_TASK_EARLY: the plan (from the workspace's header, written when the task was built),
   * the first items (settled lengths) and their keys' warm-up come before the wait for q, k, v */
  if (threadIdx.x == 0) sh.plan = gpuos_attn_plan(t);
  __syncthreads();
  GPUOS_MARK(0);
  gpuos_attn_warm(t, sh);
  GPUOS_MARK(6); /* the warm-up issued, before the wait */
  gpuos_await(t);
  /* Few versions of the loops: dims per lane rounded up to a power of two. */
  const int d = sh.plan.d;
  if (d <= GPUOS_WARP) {
    gpuos_attn_mode<1>(t, sh);
  } else if (d <= 2 * GPUOS_WARP) {
    gpuos_attn_mode<2>(t, sh);
  } else if (d <= 4 * GPUOS_WARP) {
    gpuos_attn_mode<4>(t, sh);
  } else {
    gpuos_attn_mode<8>(t, sh);
  }
}

#define GPUOS_DEFINE_ATTENTION_DECODE(SYMBOL) \
  GPUOS_OPERATOR(SYMBOL) { gpuos_attention_decode(t); }
