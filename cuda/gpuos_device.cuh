/* gpuos_device.cuh: device helpers every operator is built from.
 *
 * Loads and stores of any GPUOS dtype (computing in fp32), strided index arithmetic over a
 * GpuosTensorRef, rows, warp/block reductions and thread groups. NVRTC ships no cuda_fp16.h or
 * cuda_bf16.h, so the half conversions are inline PTX (bf16 rounding in integer arithmetic before
 * sm_80).
 *
 * Contract for every operator built on these: blockDim.x is a multiple of 32 and at most 1024;
 * every ref has fewer than 2^32 elements (index arithmetic divides in 32 bits, see
 * gpuos_offset_dims); refs are taken by reference into task memory (a by-value copy would put a
 * runtime-indexed array in local memory).
 *
 * Registers: an operator is an ABI function called through the jump table, and the linker gives
 * the worker the largest register count of any function it may call (docs/DESIGN.md, runtime
 * protocol 1). Hence no calls inside operators (64-bit division, IEEE division and sqrtf are
 * calls), rolled loops that batch their loads explicitly, branch-free loads, and pointer walks
 * instead of per-index offsets; see gpuos_div, GPUOS_ROLLED, GPUOS_ILP and gpuos_load_ptr.
 * Measured (H100, scripts of the helper that wrote this): uncapped, ptxas spreads an operator over
 * 100-200 registers; with NVRTC --maxrregcount=96 (now 128: gpuos_core/jit.py) every operator fits
 * with at most a few hundred bytes of stack (mostly saved callee-saved registers).
 * Task memory is read with plain loads, never __ldg/__restrict__: a persistent worker reuses ring
 * slots during one launch, and the non-coherent read-only cache could serve a stale descriptor. */
#pragma once

#include "gpuos_abi.h"

/* Tensor cores by mma.sync m16n8k16 and cp.async need sm_80. On sm_75 (T4) the operators' fast
 * paths are off (their `fast` checks include GPUOS_SM80), they take their CUDA-core paths, and
 * the sm_80 instructions compile to a trap that is never reached. */
#if __CUDA_ARCH__ >= 800
#define GPUOS_SM80 1
#else
#define GPUOS_SM80 0
#endif
/* Warpgroup products (wgmma) exist only in sm_90a, the arch-specific target that jit.device_arch
 * picks for compute capability 9.0: the linear's 64-row m-blocks use them there. */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GPUOS_WGMMA 1
#else
#define GPUOS_WGMMA 0
#endif

__device__ __forceinline__ unsigned long long gpuos_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int gpuos_smid() {
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

/* Diagnostics (CudaConfig.trace compiles every unit with GPUOS_TRACE; CudaBackend.trace reads
 * the tables, bench/step_trace.py shows them). Per ticket, in row ticket % GPUOS_TRACE_SLOTS:
 * gpuos_trace holds [(SM << 48) | (ticket + 1), claimed, waits met, outputs published] (globaltimer
 * ns, thread 0 of the block that ran it); gpuos_trace_marks holds the times an operator reached
 * its GPUOS_MARK(k) points (the last item's, when a record has several). A mark finds its record
 * through gpuos_trace_ticket[SM], which assumes one worker block per SM (the default). */
#ifdef GPUOS_TRACE
#define GPUOS_TRACE_SLOTS (1 << 16)
#define GPUOS_TRACE_MARKS 8
#define GPUOS_TRACE_SMS 1024
extern "C" __device__ unsigned long long gpuos_trace[GPUOS_TRACE_SLOTS][4];
extern "C" __device__ unsigned long long gpuos_trace_marks[GPUOS_TRACE_SLOTS][GPUOS_TRACE_MARKS];
extern "C" __device__ long long gpuos_trace_ticket[GPUOS_TRACE_SMS];
/* table[the record this block runs][k] = now, by thread 0: GPUOS_MARK's marks, GPUOS_TRACE_NOW's
 * fields of gpuos_trace (2: waits met, 3: outputs published). */
#define GPUOS_TRACE_INTO(table, k)                                                             \
  do {                                                                                         \
    if (threadIdx.x == 0)                                                                      \
      table[gpuos_trace_ticket[gpuos_smid()] & (GPUOS_TRACE_SLOTS - 1)][k] = gpuos_now_ns();   \
  } while (0)
#define GPUOS_MARK(k) GPUOS_TRACE_INTO(gpuos_trace_marks, k)
#define GPUOS_TRACE_NOW(field) GPUOS_TRACE_INTO(gpuos_trace, field)
#else
#define GPUOS_MARK(k) ((void)0)
#define GPUOS_TRACE_NOW(field) ((void)0)
#endif

/* Keep the loop that follows rolled: unrolled by ptxas, loops hoist the loads of several
 * iterations into dozens of extra registers, which every worker thread then pays for. Loops that
 * need loads in flight together say so explicitly, GPUOS_ILP at a time (gpuos_each). */
#define GPUOS_ROLLED _Pragma("unroll 1")

/* Loads each thread keeps in flight in a streaming loop. The worker runs few warps per SM, so
 * latency is hidden by loads in flight per thread rather than by more warps. */
#define GPUOS_ILP 4

#define GPUOS_WARP 32
#define GPUOS_ALL_LANES 0xffffffffu
#define GPUOS_ALL_DIMS 0xffffffffu

/* -inf without math.h (NVRTC has no INFINITY macro guarantee). */
__device__ __forceinline__ float gpuos_neg_inf() { return __int_as_float(0xff800000); }

/* exp(a - b), and 0 when a is -inf: online-softmax rescaling must not turn -inf - -inf into NaN. */
__device__ __forceinline__ float gpuos_exp_diff(float a, float b) {
  return a == gpuos_neg_inf() ? 0.0f : expf(a - b);
}

/* 2^x on the special-function unit (ex2.approx: relative error below 2^-22; 2^-inf = 0), where
 * expf's range reduction would be a dozen instructions: softmax's exponentials in base 2 with
 * log2(e) folded into their scale. */
__device__ __forceinline__ float gpuos_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#define GPUOS_LOG2E 1.4426950408889634f
#define GPUOS_LN2 0.6931471805599453f

/* a / b for the divisors operators use (counts, softmax sums >= 1): __fdividef, within 2 ulp.
 * IEEE `/`, sqrtf and __frcp_rn compile to a call to a slow-path routine, and a call inside an
 * operator parks its live values in high registers, which raises the whole worker's count. */
__device__ __forceinline__ float gpuos_div(float a, float b) { return __fdividef(a, b); }

/* ---- events of device programs (gpuos_abi.h, gpuos_worker.cu) ------------------------------- */

__device__ __forceinline__ unsigned int gpuos_acquire_u32(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* Counts one arrival of `last + 1` in on `counter` (wrapping to zero after the last, so it is
 * ready for the next run) and returns whether it was the last. One thread calls it for its
 * block or warp, after a barrier (bar.sync, __syncwarp) behind every writer of what the arrival
 * announces: the barrier makes their writes visible to the caller, the release is cumulative
 * over them, and the acquire makes the other arrivals' writes visible to the caller, which the
 * barrier after it extends to the readers. One acq_rel atomic, where a fence in every thread
 * before and after an atomicInc did the same. */
__device__ __forceinline__ bool gpuos_count_in(unsigned int* counter, unsigned int last) {
  unsigned int seen;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
               : "=r"(seen)
               : "l"(counter), "r"(last)
               : "memory");
  return seen == last;
}

/* Thread 0 polls until every event `need` names has reached the task's count for it, all of
 * them in flight together, with acquire loads (the producers' writes they released are then
 * visible to thread 0; the caller's barrier orders every other thread after it). Returns what it
 * saw of wait[0]. */
__device__ __forceinline__ unsigned int gpuos_poll_events(const GpuosTask* task,
                                                          const bool (&need)[GPUOS_MAX_WAITS]) {
  const unsigned int* events = reinterpret_cast<const unsigned int*>(task->events);
  for (;;) {
    unsigned int seen[GPUOS_MAX_WAITS];
    bool ready = true;
#pragma unroll
    for (int k = 0; k < GPUOS_MAX_WAITS; ++k)
      seen[k] = need[k] ? gpuos_acquire_u32(events + task->wait[k]) : 0u;
#pragma unroll
    for (int k = 0; k < GPUOS_MAX_WAITS; ++k)
      ready = ready && (!need[k] || seen[k] >= task->wait_count[k]);
    if (ready) return seen[0];
    __nanosleep(32);
  }
}

/* Ask L2 for the 128-byte line holding p: a hint that reads nothing into registers, so it may
 * run before the producers of that memory are done (the warm-ups of GPUOS_TASK_EARLY operators). */
__device__ __forceinline__ void gpuos_prefetch_line(const char* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/* Whether input k of the record can be read before its wait: the host marked the input settled
 * (GPUOS_TASK_SETTLED), or the record waits for nothing. */
__device__ __forceinline__ bool gpuos_settled(const GpuosTask* task, int k) {
  bool waits = false;
#pragma unroll
  for (int w = 0; w < GPUOS_MAX_WAITS; ++w) waits = waits || task->wait[w] != GPUOS_NO_EVENT;
  return !waits || (task->flags & GPUOS_TASK_SETTLED(k)) != 0;
}

/* The worker block's dynamic shared memory (GPUOS_DYNAMIC_SMEM in gpuos_abi.h). */
extern __shared__ __align__(128) char gpuos_dynamic_smem[];

/* Bytes of gpuos_dynamic_smem this launch has. */
__device__ __forceinline__ unsigned int gpuos_dynamic_smem_bytes() {
  unsigned int bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

/* The wait of a GPUOS_TASK_EARLY record, by all threads of the block, once its operator's
 * input-free work is under way: returns when the record's inputs are ready to read. */
__device__ __forceinline__ void gpuos_await(const GpuosTask* task) {
  if (task->events != 0) { /* uniform over the block: the task is in shared memory */
    if (threadIdx.x == 0) {
      bool need[GPUOS_MAX_WAITS];
#pragma unroll
      for (int k = 0; k < GPUOS_MAX_WAITS; ++k) need[k] = task->wait[k] != GPUOS_NO_EVENT;
      gpuos_poll_events(task, need);
    }
    __syncthreads();
  }
  GPUOS_TRACE_NOW(2);
}

/* Whether the record signals an event (a program's record; a plain batch's signal none). */
__device__ __forceinline__ bool gpuos_signals(const GpuosTask* task) {
  return task->events != 0 && task->signal != GPUOS_NO_EVENT;
}

/* Publishes the record's outputs: adds one to the event it signals, if any. Thread 0 only, after
 * a barrier behind the record's last write: the barrier makes every thread's writes visible to
 * thread 0 and the release is cumulative, so a consumer whose acquire sees the count sees the
 * outputs. */
__device__ __forceinline__ void gpuos_signal(const GpuosTask* task) {
  GPUOS_TRACE_NOW(3);
  if (!gpuos_signals(task)) return;
  unsigned int* counter = reinterpret_cast<unsigned int*>(task->events) + task->signal;
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

/* Defines operator version SYMBOL, a GpuosOpFn; the braced body that follows the macro sees the
 * record as `t`, and the operator signals the record's event once the body returned.
 * - The worker passes the record's copy in its shared memory (gpuos_fetch in gpuos_worker.cu).
 *   Saying so to the compiler turns the body's reads of the record from generic loads into
 *   shared-memory loads: in bench/linear_call.cu a linear record took 0.3 us longer at one row
 *   and 1.3 us at 64 with the record behind a generic pointer.
 * - Signalling here rather than in the worker after the call lets consumers start while the
 *   call's epilogue reloads its callee-saved registers (~0.5 us a record, bench/NOTES.md). */
#define GPUOS_OPERATOR(SYMBOL)                                       \
  __device__ __forceinline__ void SYMBOL##_body(const GpuosTask* t); \
  extern "C" __device__ void SYMBOL(const GpuosTask* t) {            \
    __builtin_assume(__isShared(t));                                 \
    SYMBOL##_body(t);                                                \
    __syncthreads();                                                 \
    if (threadIdx.x == 0) gpuos_signal(t);                           \
  }                                                                  \
  __device__ __forceinline__ void SYMBOL##_body(const GpuosTask* t)

/* GPUOS_OPERATOR whose body runs once the record's events are met (gpuos_await): the form of
 * every operator with nothing to do before its wait. */
#define GPUOS_AWAITING_OPERATOR(SYMBOL)                                 \
  __device__ __forceinline__ void SYMBOL##_awaited(const GpuosTask* t); \
  GPUOS_OPERATOR(SYMBOL) {                                              \
    gpuos_await(t);                                                     \
    SYMBOL##_awaited(t);                                                \
  }                                                                     \
  __device__ __forceinline__ void SYMBOL##_awaited(const GpuosTask* t)

/* ---- dtype conversions ---------------------------------------------------------------------- */

__device__ __forceinline__ float gpuos_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short gpuos_f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

/* bf16 is the top half of an fp32, so widening is a shift. */
__device__ __forceinline__ float gpuos_bf16_to_f32(unsigned short b) {
  return __uint_as_float(static_cast<unsigned int>(b) << 16);
}

/* The 16 bits of a bf16 (BF16) or an fp16, widened: for code that knows its dtype at compile
 * time (the tensor-core paths). */
template <bool BF16>
__device__ __forceinline__ float gpuos_16_to_f32(unsigned short h) {
  return BF16 ? gpuos_bf16_to_f32(h) : gpuos_f16_to_f32(h);
}

/* Round to nearest even, as cvt.rn.bf16.f32 does (sm_80+); before sm_80 the same in integer
 * arithmetic: add half an ulp of bf16 (less one when the kept bit is even), truncate; NaN stays a
 * quiet NaN of the same sign. */
__device__ __forceinline__ unsigned short gpuos_f32_to_bf16(float f) {
#if __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

/* The 16-bit code of `v` in `dtype` (GPUOS_DTYPE_F16, else bf16). */
__device__ __forceinline__ unsigned short gpuos_f32_to_16(int dtype, float v) {
  return dtype == GPUOS_DTYPE_F16 ? gpuos_f32_to_f16(v) : gpuos_f32_to_bf16(v);
}

/* Two floats' 16-bit codes in `dtype` as one word, lo in its low half (memory order). */
__device__ __forceinline__ unsigned int gpuos_f32x2_to_16(int dtype, float lo, float hi) {
  return gpuos_f32_to_16(dtype, lo) | static_cast<unsigned int>(gpuos_f32_to_16(dtype, hi)) << 16;
}

/* `v` rounded to a float `dtype` and widened back: what storing it and loading it again reads. */
__device__ __forceinline__ float gpuos_round_to(int dtype, float v) {
  if (dtype == GPUOS_DTYPE_F16) return gpuos_f16_to_f32(gpuos_f32_to_f16(v));
  return dtype == GPUOS_DTYPE_BF16 ? gpuos_bf16_to_f32(gpuos_f32_to_bf16(v)) : v;
}

/* ---- loads and stores ----------------------------------------------------------------------- */

/* Bytes per element of a GPUOS_DTYPE_* (4 for I32; an unknown code reads as f32, as in the loads). */
__device__ __forceinline__ int gpuos_dtype_size(int dtype) {
  return dtype == GPUOS_DTYPE_F16 || dtype == GPUOS_DTYPE_BF16 ? 2 : 4;
}

/* Loads that bypass L1 (__ldcg: ld.global.cg). The persistent worker runs for a whole lease, and an
 * SM's L1 is not coherent and not invalidated within one launch: a plain load could return what
 * the buffer held when this SM last read it, before torch (or the ring copy) rewrote it. */
__device__ __forceinline__ unsigned int gpuos_ld_u32(const void* p) {
  return __ldcg(reinterpret_cast<const unsigned int*>(p));
}

__device__ __forceinline__ unsigned short gpuos_ld_u16(const void* p) {
  return __ldcg(reinterpret_cast<const unsigned short*>(p));
}

/* gpuos_ld_u16 where `in`, else 0: a predicated load, no branch, so that a run of them is in
 * flight together (each behind a branch of its own waited for the one before). */
__device__ __forceinline__ unsigned short gpuos_ld_u16_if(bool in, const void* p) {
  unsigned short v;
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\nmov.b16 %0, 0;\n"
               "@q ld.global.cg.u16 %0, [%1];\n}"
               : "=h"(v)
               : "l"(p), "r"(static_cast<int>(in)));
  return v;
}

/* The element of GPUOS_DTYPE_* `dtype` at byte address `p`, as fp32. Branch-free (a predicated
 * load of each width, then selects) so that loads of several elements stay in one basic block
 * and can be in flight together; a branch per dtype serialised them. */
__device__ __forceinline__ float gpuos_load_ptr(const char* p, int dtype) {
  const bool half = dtype == GPUOS_DTYPE_F16 || dtype == GPUOS_DTYPE_BF16;
  const unsigned int bits = half ? gpuos_ld_u16(p) : gpuos_ld_u32(p);
  const float f16 = gpuos_f16_to_f32(static_cast<unsigned short>(bits));
  return dtype == GPUOS_DTYPE_F16 ? f16
                                  : __uint_as_float(dtype == GPUOS_DTYPE_BF16 ? bits << 16 : bits);
}

/* The GPUOS_DTYPE_I32 index (a length, position or row number) at byte address `p`. Indices live
 * in device tensors that earlier tasks or the host rewrite between runs, hence the L1 bypass. */
__device__ __forceinline__ int gpuos_load_i32(const char* p) {
  return static_cast<int>(gpuos_ld_u32(p));
}

/* Store fp32 `v` at byte address `p` as `dtype`, rounding to nearest even; branch-free too. */
__device__ __forceinline__ void gpuos_store_ptr(char* p, int dtype, float v) {
  if (dtype == GPUOS_DTYPE_F16 || dtype == GPUOS_DTYPE_BF16) {
    *reinterpret_cast<unsigned short*>(p) = gpuos_f32_to_16(dtype, v);
  } else {
    *reinterpret_cast<float*>(p) = v;
  }
}

/* Byte address of `ref`'s element (0, ..., 0). Tensors are in global memory (device memory or
 * mapped host memory; an empty one's address is never read): saying so makes stores through it
 * global stores, which the compiler then knows leave the record (in shared memory,
 * GPUOS_OPERATOR) unchanged, so it need not read the record's fields again after each store. */
__device__ __forceinline__ char* gpuos_data(const GpuosTensorRef& ref) {
  char* p = reinterpret_cast<char*>(ref.data);
  __builtin_assume(__isGlobal(p));
  return p;
}

/* Byte address of the element at element offset `off` of `ref`. */
__device__ __forceinline__ char* gpuos_ptr(const GpuosTensorRef& ref, int64_t off) {
  return gpuos_data(ref) + off * gpuos_dtype_size(ref.dtype);
}

/* Bytes between neighbours along dim d of `ref`. */
__device__ __forceinline__ int64_t gpuos_step(const GpuosTensorRef& ref, int d) {
  return ref.strides[d] * gpuos_dtype_size(ref.dtype);
}

/* Element at element offset `off` of `ref` (from gpuos_offset, gpuos_row_offset, ...). */
__device__ __forceinline__ float gpuos_load(const GpuosTensorRef& ref, int64_t off) {
  return gpuos_load_ptr(gpuos_ptr(ref, off), ref.dtype);
}

__device__ __forceinline__ void gpuos_store(const GpuosTensorRef& ref, int64_t off, float v) {
  gpuos_store_ptr(gpuos_ptr(ref, off), ref.dtype, v);
}

/* ---- vectors of four ------------------------------------------------------------------------ */

/* Whether element `off` of `ref` starts a 4-element group that one vector access can move (its
 * address is aligned to 4 elements: 16 bytes of fp32, 8 of fp16/bf16). */
__device__ __forceinline__ bool gpuos_aligned4(const GpuosTensorRef& ref, int64_t off) {
  const unsigned long long bytes = 4ull * gpuos_dtype_size(ref.dtype);
  return (reinterpret_cast<unsigned long long>(gpuos_ptr(ref, off)) & (bytes - 1)) == 0;
}

/* The 4 values of a vector load's word: 4 fp32 (uint4), or 4 fp16/bf16 of `dtype` (uint2). */
__device__ __forceinline__ void gpuos_unpack4(const uint4& f, int, float (&v)[4]) {
  v[0] = __uint_as_float(f.x), v[1] = __uint_as_float(f.y);
  v[2] = __uint_as_float(f.z), v[3] = __uint_as_float(f.w);
}

__device__ __forceinline__ void gpuos_unpack4(const uint2& w, int dtype, float (&v)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const unsigned short h = static_cast<unsigned short>((j < 2 ? w.x : w.y) >> (16 * (j & 1)));
    v[j] = dtype == GPUOS_DTYPE_F16 ? gpuos_f16_to_f32(h) : gpuos_bf16_to_f32(h);
  }
}

/* The word of a vector load of 4 elements of either width: `f` for fp32, `h` for fp16 and bf16
 * (the other is 0). */
struct GpuosWord4 {
  uint4 f;
  uint2 h;
};

/* The word of the 4 contiguous elements of `dtype` at byte address `p` (aligned to 4 elements).
 * Branch-free like gpuos_load_ptr (a predicated load of each width), so that the loads of several
 * tensors of different dtypes are in flight together. Callers that need many loads in flight
 * issue them all before unpacking any (gpuos_unpack_word4): the unpack waits for its load. */
__device__ __forceinline__ GpuosWord4 gpuos_load_word4(const char* p, int dtype) {
  const bool wide = dtype == GPUOS_DTYPE_F32;
  return GpuosWord4{wide ? __ldcg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0),
                    wide ? make_uint2(0, 0) : __ldcg(reinterpret_cast<const uint2*>(p))};
}

/* The 4 values of `word`, loaded as `dtype` (gpuos_load_word4). */
__device__ __forceinline__ void gpuos_unpack_word4(const GpuosWord4& word, int dtype, float (&v)[4]) {
  float four[4], half[4];
  gpuos_unpack4(word.f, dtype, four);
  gpuos_unpack4(word.h, dtype, half);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = dtype == GPUOS_DTYPE_F32 ? four[j] : half[j];
}

/* The 4 contiguous elements of `dtype` at byte address `p` (aligned to 4 elements), with one
 * vector load (gpuos_load_word4). */
__device__ __forceinline__ void gpuos_load4_ptr(const char* p, int dtype, float (&v)[4]) {
  gpuos_unpack_word4(gpuos_load_word4(p, dtype), dtype, v);
}

/* Elements off .. off + 3 of a contiguous `ref` with one vector load (gpuos_aligned4 must hold). */
__device__ __forceinline__ void gpuos_load4(const GpuosTensorRef& ref, int64_t off, float (&v)[4]) {
  gpuos_load4_ptr(gpuos_ptr(ref, off), ref.dtype, v);
}

/* Store v into elements off .. off + 3 of a contiguous `ref` with one vector store. */
__device__ __forceinline__ void gpuos_store4(const GpuosTensorRef& ref, int64_t off, const float (&v)[4]) {
  char* p = gpuos_ptr(ref, off);
  if (ref.dtype == GPUOS_DTYPE_F32) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  *reinterpret_cast<uint2*>(p) = make_uint2(gpuos_f32x2_to_16(ref.dtype, v[0], v[1]),
                                            gpuos_f32x2_to_16(ref.dtype, v[2], v[3]));
}

/* ---- index arithmetic ----------------------------------------------------------------------- */

/* Element offset in `strides` of the element whose row-major index over the dims of `shape`
 * selected by `dims` (bit d = dim d) is `linear`. Unselected dims take index 0. `shape` and
 * `strides` may be different refs: reductions walk the output's shape with the input's strides.
 * Divides in 32 bits because a 64-bit division is a call (see gpuos_div); every linear index and
 * size fits since every ref has fewer than 2^32 elements. */
__device__ __forceinline__ int64_t gpuos_offset_dims(const GpuosTensorRef& shape,
                                                     const GpuosTensorRef& strides, int64_t linear,
                                                     unsigned int dims) {
  unsigned int rest = static_cast<unsigned int>(linear);
  int64_t off = 0;
#pragma unroll
  for (int d = GPUOS_MAX_DIMS - 1; d >= 0; --d) {
    if (d < shape.ndim && ((dims >> d) & 1u)) {
      const unsigned int size = static_cast<unsigned int>(shape.sizes[d]), quot = rest / size;
      off += static_cast<int64_t>(rest - quot * size) * strides.strides[d];
      rest = quot;
    }
  }
  return off;
}

/* Element offset of the element at row-major index `linear` over `ref`'s own sizes. */
__device__ __forceinline__ int64_t gpuos_offset(const GpuosTensorRef& ref, int64_t linear) {
  return gpuos_offset_dims(ref, ref, linear, GPUOS_ALL_DIMS);
}

/* Number of elements in the dims of `ref` selected by `dims`. */
__device__ __forceinline__ int64_t gpuos_numel_dims(const GpuosTensorRef& ref, unsigned int dims) {
  int64_t n = 1;
#pragma unroll
  for (int d = 0; d < GPUOS_MAX_DIMS; ++d) {
    if (d < ref.ndim && ((dims >> d) & 1u)) n *= ref.sizes[d];
  }
  return n;
}

/* True when the dims of `ref` selected by `dims` are laid out row-major among themselves with no
 * gaps and no broadcast, so element k of them (row-major over those dims) sits k elements past
 * their first. Dims of size 1 never move the index, so their stride is ignored. */
__device__ __forceinline__ bool gpuos_dims_packed(const GpuosTensorRef& ref, unsigned int dims) {
  int64_t expect = 1;
  bool ok = true;
#pragma unroll
  for (int d = GPUOS_MAX_DIMS - 1; d >= 0; --d) {
    if (d < ref.ndim && ((dims >> d) & 1u) && ref.sizes[d] != 1) {
      ok = ok && ref.strides[d] == expect;
      expect *= ref.sizes[d];
    }
  }
  return ok;
}

/* The whole of `ref` packed: the element at linear index i lives at offset i. */
__device__ __forceinline__ bool gpuos_is_contiguous(const GpuosTensorRef& ref) {
  return gpuos_dims_packed(ref, GPUOS_ALL_DIMS);
}

/* ---- rows: the last dim ------------------------------------------------------------------- */

/* Length of a row (the last dim; 1 for a 0-dim ref). */
__device__ __forceinline__ int64_t gpuos_row_len(const GpuosTensorRef& ref) {
  return ref.ndim > 0 ? ref.sizes[ref.ndim - 1] : 1;
}

/* One row of a tensor with its address fields in registers, so that a loop over the row does not
 * re-read the descriptor: element j is at byte address p + j * step. `ref` is the descriptor it
 * came from; only gpuos_seek reads it, so it costs no register in the loops. */
struct GpuosRow {
  char* p;
  int64_t step;
  int dtype;
  const GpuosTensorRef* ref;

  __device__ __forceinline__ float load(int64_t j) const {
    return gpuos_load_ptr(p + j * step, dtype);
  }
  __device__ __forceinline__ void store(int64_t j, float v) const {
    gpuos_store_ptr(p + j * step, dtype, v);
  }
  /* Move by index i along dim d of ref. */
  __device__ __forceinline__ void advance(int d, int64_t i) { p += i * gpuos_step(*ref, d); }
};

/* Row 0 of `ref`: also how a 1-D ref (a weight over the last dim) is read. Reading the fields of
 * an unused ref is harmless: nothing is loaded through it. */
__device__ __forceinline__ GpuosRow gpuos_vector(const GpuosTensorRef& ref) {
  GpuosRow row;
  row.p = gpuos_data(ref);
  row.step = ref.ndim > 0 ? gpuos_step(ref, ref.ndim - 1) : 0;
  row.dtype = ref.dtype;
  row.ref = &ref;
  return row;
}

/* Move each of `rows` (anything with `advance(d, i)`, starting at row 0) to row `r`, numbered
 * row-major over the first `lead` dims of `shape`; all the rows' refs share those dims' sizes.
 * r is decomposed once for all rows, in a rolled loop: per-ref unrolled decompositions let the
 * scheduler interleave every dim of every ref, which cost rotary ~100 registers. */
template <class... Rows>
__device__ __forceinline__ void gpuos_seek(const GpuosTensorRef& shape, int lead, int64_t r,
                                           Rows&... rows) {
  unsigned int rest = static_cast<unsigned int>(r);
  GPUOS_ROLLED
  for (int d = min(lead, GPUOS_MAX_DIMS) - 1; d >= 0; --d) {
    const unsigned int size = static_cast<unsigned int>(shape.sizes[d]), quot = rest / size;
    const int64_t i = rest - quot * size;
    (rows.advance(d, i), ...);
    rest = quot;
  }
}

/* Number of leading dims of `ref` that number its rows (all but the last). */
__device__ __forceinline__ int gpuos_row_dims(const GpuosTensorRef& ref) {
  return ref.ndim > 0 ? ref.ndim - 1 : 0;
}

/* Row `r` of `ref` (row-major over all dims but the last). Rows of several refs with the same
 * leading sizes are cheaper through one gpuos_seek. */
__device__ __forceinline__ GpuosRow gpuos_row(const GpuosTensorRef& ref, int64_t r) {
  GpuosRow row = gpuos_vector(ref);
  gpuos_seek(ref, gpuos_row_dims(ref), r, row);
  return row;
}

/* Element offset of element j of row r of `ref`, for one-off accesses (a loop over a row is
 * cheaper through gpuos_row). */
__device__ __forceinline__ int64_t gpuos_row_offset(const GpuosTensorRef& ref, int64_t r,
                                                    int64_t j) {
  const int lead = gpuos_row_dims(ref);
  return gpuos_offset_dims(ref, ref, r, (1u << lead) - 1u) +
         (ref.ndim > 0 ? j * ref.strides[lead] : 0);
}

/* ---- batched loops ------------------------------------------------------------------------- */

/* For k = first, first + step, ... < n: f(k, element at addr(k)), loading GPUOS_ILP elements before
 * using any so that their loads are in flight together. Past the end, addr(first) is loaded
 * instead (always valid when the loop runs) and f is not called, which keeps the batch
 * branch-free. f may store to the elements it is given (in place is safe: each is loaded first). */
template <class Addr, class F>
__device__ __forceinline__ void gpuos_each(int64_t first, int64_t n, int64_t step, int dtype,
                                           Addr addr, F f) {
  GPUOS_ROLLED
  for (int64_t k0 = first; k0 < n; k0 += GPUOS_ILP * step) {
    float v[GPUOS_ILP];
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t k = k0 + u * step;
      v[u] = gpuos_load_ptr(addr(k < n ? k : first), dtype);
    }
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      if (k0 + u * step < n) f(k0 + u * step, v[u]);
    }
  }
}

/* gpuos_row_quads for one width of load, WORD: uint4 (fp32) or uint2 (fp16, bf16). */
template <class G, int U, class WORD, class F4>
__device__ __forceinline__ void gpuos_row_quads_as(const GpuosRow& row, int64_t quads, F4 f4) {
  const WORD* words = reinterpret_cast<const WORD*>(row.p);
  GPUOS_ROLLED
  for (int64_t c0 = G::rank(); c0 < quads; c0 += U * G::size()) {
    WORD w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * G::size();
      w[u] = __ldcg(words + (c < quads ? c : c0));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * G::size();
      float v[4];
      gpuos_unpack4(w[u], row.dtype, v);
      if (c < quads) f4(c, v);
    }
  }
}

/* Groups of 4 [0, quads) of a contiguous row aligned to 4 elements (gpuos_row_head 0), one vector
 * load a group, U loads a thread in flight: f4(c, v) with v the 4 values of group c, each
 * thread's groups in increasing order, shared by the threads of group G. One width of load a
 * loop: with both (gpuos_load4_ptr), ptxas waited for each load's values before issuing the
 * next ones, 3 of 8 in flight, and a row of 128K logits took 35 µs on one SM. */
template <class G, int U, class F4>
__device__ __forceinline__ void gpuos_row_quads(const GpuosRow& row, int64_t quads, F4 f4) {
  if (row.dtype == GPUOS_DTYPE_F32) {
    gpuos_row_quads_as<G, U, uint4>(row, quads, f4);
  } else {
    gpuos_row_quads_as<G, U, uint2>(row, quads, f4);
  }
}

/* Elements of a contiguous row before its first one aligned to 4 elements (0 to 3, at most n);
 * n for a row of another stride. */
__device__ __forceinline__ int64_t gpuos_row_head(const GpuosRow& row, int64_t n) {
  const int64_t size = gpuos_dtype_size(row.dtype);
  if (row.step != size) return n;
  const int64_t past = (reinterpret_cast<uint64_t>(row.p) / size) & 3;
  return min(n, (4 - past) & 3);
}

/* gpuos_each over the first n elements of a row, shared by the threads of group G. With U > 0,
 * a contiguous row goes 4 elements a load from its first element aligned to 4, U loads a thread
 * in flight (the elements before it and past the last whole 4, one by one): a long row (logits:
 * 128K elements for one block) is then 4 U elements a round trip instead of GPUOS_ILP, whatever
 * its start (GPT-2's 50,257 logits a row leave 3 rows in 4 unaligned). U = 0 (short rows: the
 * loop's registers would cost more than its round trips save) keeps to single loads. Either way
 * each thread sees its j in increasing order (argmax's lowest index relies on it). */
template <class G, int U = 0, class F>
__device__ __forceinline__ void gpuos_row_each(const GpuosRow& row, int64_t n, F f) {
  const auto at = [&](int64_t j) { return row.p + j * row.step; };
  int64_t rest = 0; /* where the single loads after the vector loop start */
  if constexpr (U > 0) {
    const int64_t head = gpuos_row_head(row, n), quads = (n - head) / 4;
    gpuos_each(G::rank(), head, G::size(), row.dtype, at, f);
    GpuosRow body = row;
    body.p += head * row.step;
    gpuos_row_quads<G, U>(body, quads, [&](int64_t c, const float(&v)[4]) {
#pragma unroll
      for (int e = 0; e < 4; ++e) f(head + 4 * c + e, v[e]);
    });
    rest = head + 4 * quads;
  }
  gpuos_each(rest + G::rank(), n, G::size(), row.dtype, at, f);
}

/* gpuos_row_each over two rows of the same length together: f(j, a[j], b[j]), with the loads of
 * both rows GPUOS_ILP at a time in flight (past the end, element first is loaded and f is not
 * called). f may store to a[j] or b[j]: both are loaded first. B: anything with `load(j)` (a
 * GpuosRow, or a sum of rows). */
template <class G, class B, class F>
__device__ __forceinline__ void gpuos_row_each2(const GpuosRow& a, const B& b, int64_t n, F f) {
  const int64_t first = G::rank(), step = G::size();
  GPUOS_ROLLED
  for (int64_t k0 = first; k0 < n; k0 += GPUOS_ILP * step) {
    float va[GPUOS_ILP], vb[GPUOS_ILP];
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      const int64_t k = k0 + u * step < n ? k0 + u * step : first;
      va[u] = a.load(k);
      vb[u] = b.load(k);
    }
#pragma unroll
    for (int u = 0; u < GPUOS_ILP; ++u) {
      if (k0 + u * step < n) f(k0 + u * step, va[u], vb[u]);
    }
  }
}

/* ---- reductions ----------------------------------------------------------------------------- */

/* Sum / max over the 32 lanes of a warp; every lane gets the result. Needs a converged warp. */
__device__ __forceinline__ float gpuos_warp_sum(float v) {
#pragma unroll
  for (int o = GPUOS_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(GPUOS_ALL_LANES, v, o);
  return v;
}

__device__ __forceinline__ float gpuos_warp_max(float v) {
#pragma unroll
  for (int o = GPUOS_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(GPUOS_ALL_LANES, v, o));
  return v;
}

/* Block-wide reductions: all threads of the block must call; every thread gets the result.
 * Requires blockDim.x a multiple of 32 and <= 1024. The leading barrier keeps a fast warp from
 * overwriting `partial` while a slow one still reads the previous call's values, so the functions
 * can be called back to back; each warp then reduces the per-warp partials itself, which
 * broadcasts the result without a third barrier. */
__device__ __forceinline__ float gpuos_block_sum(float v) {
  __shared__ float partial[GPUOS_WARP];
  const unsigned int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  v = gpuos_warp_sum(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return gpuos_warp_sum(lane < blockDim.x / GPUOS_WARP ? partial[lane] : 0.0f);
}

__device__ __forceinline__ float gpuos_block_max(float v) {
  __shared__ float partial[GPUOS_WARP];
  const unsigned int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  v = gpuos_warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return gpuos_warp_max(lane < blockDim.x / GPUOS_WARP ? partial[lane] : gpuos_neg_inf());
}

/* ---- thread groups -------------------------------------------------------------------------- */

/* A group of threads that processes one row together: a warp (many short rows at once, no
 * barriers) or the whole block (long rows). Row operators are templates over the group. */
struct GpuosWarpGroup {
  __device__ static unsigned int rank() { return threadIdx.x % GPUOS_WARP; }
  __device__ static unsigned int size() { return GPUOS_WARP; }
  __device__ static unsigned int index() { return threadIdx.x / GPUOS_WARP; }
  __device__ static unsigned int count() { return blockDim.x / GPUOS_WARP; }
  __device__ static float sum(float v) { return gpuos_warp_sum(v); }
  __device__ static float max(float v) { return gpuos_warp_max(v); }
};

struct GpuosBlockGroup {
  __device__ static unsigned int rank() { return threadIdx.x; }
  __device__ static unsigned int size() { return blockDim.x; }
  __device__ static unsigned int index() { return 0; }
  __device__ static unsigned int count() { return 1; }
  __device__ static float sum(float v) { return gpuos_block_sum(v); }
  __device__ static float max(float v) { return gpuos_block_max(v); }
};

/* Threads of the block's pair of warps p (warps 2p, 2p + 1) wait for each other: named barrier
 * p + 1 (0 is __syncthreads'), so at most 15 pairs: blockDim.x <= 960. */
__device__ __forceinline__ void gpuos_pair_sync(unsigned int pair) {
  asm volatile("bar.sync %0, 64;" ::"r"(pair + 1) : "memory");
}

/* Sum over a pair of warps, every thread of the pair getting it; the leading barrier as
 * gpuos_block_sum's, the warps' partials added in warp order. */
__device__ __forceinline__ float gpuos_pair_sum(float v) {
  __shared__ float partial[GPUOS_WARP];
  const unsigned int lane = threadIdx.x % GPUOS_WARP, warp = threadIdx.x / GPUOS_WARP;
  v = gpuos_warp_sum(v);
  gpuos_pair_sync(warp / 2);
  if (lane == 0) partial[warp] = v;
  gpuos_pair_sync(warp / 2);
  return partial[warp & ~1u] + partial[warp | 1u];
}

/* A pair of warps a row (sums only): a block's few rows side by side where each is too long for
 * a warp (a prefill record's 4 residual rows of 768, which a block took one after another). */
struct GpuosPairGroup {
  __device__ static unsigned int rank() { return threadIdx.x % (2 * GPUOS_WARP); }
  __device__ static unsigned int size() { return 2 * GPUOS_WARP; }
  __device__ static unsigned int index() { return threadIdx.x / (2 * GPUOS_WARP); }
  __device__ static unsigned int count() { return blockDim.x / (2 * GPUOS_WARP); }
  __device__ static float sum(float v) { return gpuos_pair_sum(v); }
};

/* Rows at most this long go one per warp even when the task has fewer rows than warps. */
#define GPUOS_WARP_ROW_MAX 256

/* Whether rows of length `len` go a warp each (short rows, or plenty: no barriers, every warp
 * busy), else the whole block each. Depends on the task only, so it is uniform over the block,
 * which the block group's barriers require. */
__device__ __forceinline__ bool gpuos_rows_by_warp(const GpuosTask* t, int64_t len) {
  const int64_t rows = t->range_end - t->range_begin;
  return rows >= static_cast<int64_t>(GpuosWarpGroup::count()) || len <= GPUOS_WARP_ROW_MAX;
}

/* f(r) for each row r of the task that group G's instance of this thread takes. */
template <class G, class F>
__device__ __forceinline__ void gpuos_each_row(const GpuosTask* t, F f) {
  GPUOS_ROLLED
  for (int64_t r = t->range_begin + G::index(); r < t->range_end; r += G::count()) f(r);
}

/* Run `Op::run<G>(t, r)` for every row r of the task, G as gpuos_rows_by_warp picks (`len`: the
 * row length the choice is based on). */
template <class Op>
__device__ __forceinline__ void gpuos_for_rows(const GpuosTask* t, int64_t len) {
  if (gpuos_rows_by_warp(t, len)) {
    gpuos_each_row<GpuosWarpGroup>(t, [&](int64_t r) { Op::template run<GpuosWarpGroup>(t, r); });
  } else {
    gpuos_each_row<GpuosBlockGroup>(t, [&](int64_t r) { Op::template run<GpuosBlockGroup>(t, r); });
  }
}
