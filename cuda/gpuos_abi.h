/* gpuos_abi.h: the task descriptor shared by the host (Python mirror: gpuos_core/abi.py) and the
 * device code. One source of truth: tests/unit/test_abi.py compiles this header with the host C
 * compiler and checks every size and offset against the Python mirror, byte for byte.
 * Plain C so that gcc, nvcc and NVRTC all read it. */
#ifndef GPUOS_ABI_H
#define GPUOS_ABI_H

#if defined(__CUDACC_RTC__)
/* NVRTC ships no libc headers. */
typedef signed char int8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#define GPUOS_ABI_VERSION 1
#define GPUOS_MAX_DIMS 6
#define GPUOS_MAX_INPUTS 3
#define GPUOS_MAX_SCALARS 4

/* Element types; every operator computes in fp32 whatever it loads and stores. */
#define GPUOS_DTYPE_F32 0
#define GPUOS_DTYPE_F16 1
#define GPUOS_DTYPE_BF16 2


/* A strided view of one tensor. Element (i0, ..., i{ndim-1}) lives at
 * data + sizeof(dtype) * sum_d(i_d * strides[d]). Broadcast dims have stride 0. */
typedef struct GpuosTensorRef {
  uint64_t data;                    /* address of element (0, ..., 0) */
  int64_t numel;                    /* product of sizes[0..ndim) */
  int64_t sizes[GPUOS_MAX_DIMS];    /* entries past ndim are 1 */
  int64_t strides[GPUOS_MAX_DIMS];  /* in elements, not bytes; entries past ndim are 0 */
  int32_t dtype;                    /* GPUOS_DTYPE_* */
  int32_t ndim;                     /* 0 (scalar) .. GPUOS_MAX_DIMS */
} GpuosTensorRef;

/* One unit of work. Its operator is the physical slot resolved on the host at enqueue time, so a
 * task keeps the operator version that was active when it was submitted. */
typedef struct GpuosTask {
  int32_t op_slot;                  /* index into the image's jump table */
  int32_t num_inputs;               /* inputs used in in[] */
  uint32_t reduce_mask;             /* reductions: bit d set = reduce over dim d of in[0] */
  int32_t reserved;                 /* 0; keeps range_begin 8-byte aligned */
  int64_t range_begin;              /* first work item (output element, or row) of this task */
  int64_t range_end;                /* one past its last work item; tiles split one op */
  float scalars[GPUOS_MAX_SCALARS]; /* operator parameters (eps, slope, scale, ...) */
  GpuosTensorRef out;
  GpuosTensorRef in[GPUOS_MAX_INPUTS];
} GpuosTask;

/* The queue's control words, in device memory beside the ring of GpuosTask records. */
typedef struct GpuosQueue {
  uint64_t tail;  /* records published; written by the host in stream order, after their copy */
  uint64_t head;  /* records claimed by worker blocks (compare-and-swap, never past tail) */
  uint64_t stop;  /* nonzero: blocks exit once nothing is left to claim (quiesce before a load) */
} GpuosQueue;

/* Every operator version is a device function with this signature, run by all threads of one
 * block together (it may use __syncthreads and static shared memory). */
#ifdef __CUDACC__
typedef void (*GpuosOpFn)(const GpuosTask *task);
#endif

#endif /* GPUOS_ABI_H */
