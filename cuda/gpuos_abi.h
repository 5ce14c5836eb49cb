/* gpuos_abi.h: the task descriptor shared by the host (Python mirror: gpuos_core/abi.py) and the
 * device code. One source of truth: tests/unit/test_abi.py compiles this header with the host C
 * compiler and checks every size and offset against the Python mirror, byte for byte.
 * Plain C so that gcc, nvcc and NVRTC all read it. */
#ifndef GPUOS_ABI_H
#define GPUOS_ABI_H

#if defined(__CUDACC_RTC__)
/* NVRTC ships no libc headers. */
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#define GPUOS_ABI_VERSION 3
#define GPUOS_MAX_DIMS 6
#define GPUOS_MAX_INPUTS 4
#define GPUOS_MAX_SCALARS 4
#define GPUOS_MAX_WAITS 2

/* Element types; every operator computes in fp32 whatever floats it loads and stores. */
#define GPUOS_DTYPE_F32 0
#define GPUOS_DTYPE_F16 1
#define GPUOS_DTYPE_BF16 2
/* Index tensors (per-run lengths, positions, slots read on the device); only inputs an operator
 * documents as indices may have it. */
#define GPUOS_DTYPE_I32 3

/* No event: a wait or signal field that is unused. */
#define GPUOS_NO_EVENT (-1)
/* op_slot of a record that runs no operator: it only waits and signals (a join of more events
 * than one record can wait for). */
#define GPUOS_OP_NOP (-2)

/* flags of a record. EARLY: its operator waits for the record's events itself (gpuos_await in
 * gpuos_device.cuh), after work that reads no input tensor (its plan, warming its weights into
 * L2), so that this work overlaps the producers; the operator awaits on every path. */
#define GPUOS_TASK_EARLY 1
/* flags, SETTLED(k): no record that this record waits for, directly or through its producers,
 * writes input k, so an EARLY operator may read that input before its wait (the linear streams
 * its weights in while x is produced). A record that waits for nothing needs no such flag. */
#define GPUOS_TASK_SETTLED(k) (2 << (k))
/* flags, LOCAL: a later record of its program waits for this record's event, so that record's
 * completion (or one after it) publishes this one's outputs to the host too: the worker writes
 * this record's completion without a system-scope fence first (gpuos_worker.cu). Records
 * without it (a program's last records, every record of a plain batch) are published with
 * one. */
#define GPUOS_TASK_LOCAL (2 << GPUOS_MAX_INPUTS)

/* Dynamic shared memory of a worker block: an operator may use gpuos_dynamic_smem
 * (gpuos_device.cuh) during its call, gpuos_dynamic_smem_bytes() of it (the backend asks for this
 * many bytes and gives less where the device has less; operators check). Nothing in it survives
 * the call. 72 KB and 128 bytes: the linear aligns its first stage to 128 bytes and keeps 72 KB
 * of stages past it. */
#define GPUOS_DYNAMIC_SMEM 73856


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
 * task keeps the operator version that was active when it was submitted.
 *
 * Dependencies (device programs): `events` points at the submission's array of uint32 counters in
 * device memory, zeroed before the submission is published. A record runs only once, for every
 * k with wait[k] != GPUOS_NO_EVENT, counter wait[k] has reached wait_count[k]; when it finishes
 * (its writes fenced) it adds one to counter `signal`. Every record that signals an event a record
 * waits for comes before it in submission order (the host checks this when it builds a program),
 * which is what makes waiting safe: see gpuos_worker.cu. */
typedef struct GpuosTask {
  int32_t op_slot;                  /* index into the image's jump table, or GPUOS_OP_NOP */
  int16_t num_inputs;               /* inputs used in in[] */
  int16_t flags;                    /* GPUOS_TASK_*: EARLY on every operator record */
  uint32_t reduce_mask;             /* reductions: bit d set = reduce over dim d of in[0] */
  int32_t signal;                   /* event counter to increment when done, or GPUOS_NO_EVENT */
  int64_t range_begin;              /* first work item (output element, or row) of this task */
  int64_t range_end;                /* one past its last work item; tiles split one op */
  float scalars[GPUOS_MAX_SCALARS]; /* operator parameters (eps, slope, scale, ...) */
  uint64_t events;                  /* address of the submission's uint32 counters; 0: none used */
  int32_t wait[GPUOS_MAX_WAITS];    /* event counters to wait for, or GPUOS_NO_EVENT */
  uint32_t wait_count[GPUOS_MAX_WAITS]; /* ... until each reaches this count */
  GpuosTensorRef out;
  GpuosTensorRef in[GPUOS_MAX_INPUTS];
} GpuosTask;

/* The queue's control words, in device memory beside the ring of GpuosTask records. */
typedef struct GpuosQueue {
  uint64_t tail;  /* records published; written by the host in stream order, after their copy */
  uint64_t head;  /* tickets taken by worker blocks (may pass tail: cuda/gpuos_worker.cu) */
  uint64_t stop;  /* nonzero: blocks exit once nothing is left to claim (quiesce before a load) */
  uint64_t claim; /* most records a block claims at once (1..GPUOS_MAX_CLAIM of the worker): the
                     host lowers it, in stream order, while dependent programs are queued */
} GpuosQueue;

/* Every operator version is a device function with this signature, run by all threads of one
 * block together (it may use __syncthreads and static shared memory). Its argument points to the
 * block's copy of the record in shared memory, and it signals the record's event when done:
 * operators are defined with GPUOS_OPERATOR (gpuos_device.cuh), which does both. */
#ifdef __CUDACC__
typedef void (*GpuosOpFn)(const GpuosTask *task);
#endif

#endif /* GPUOS_ABI_H */
