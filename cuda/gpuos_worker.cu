/* gpuos_worker.cu: the worker kernel that runs a batch of tasks through the jump table.
 *
 * Minimal form (until the CUDA backend's leased persistent worker): one launch drains one batch.
 * Each block takes tasks by ticket and runs the task's operator with all its threads; the image's
 * generated unit defines the jump table (DESIGN.md, runtime protocol 2-3). Operators need
 * blockDim.x to be a multiple of 32 and at most 1024. */
#include "gpuos_abi.h"

extern "C" __device__ GpuosOpFn gpuos_jump_table[];
extern "C" __device__ int gpuos_jump_table_size;

/* Status values written to status[i] once task i is done. */
#define GPUOS_STATUS_DONE 1
#define GPUOS_STATUS_BAD_SLOT (-1)

/* Run tasks[0, ntasks): blocks take the next task index from *next (zero before the launch) until
 * none is left. status[i] becomes GPUOS_STATUS_DONE after every thread of the block finished task
 * i and its writes were fenced, or GPUOS_STATUS_BAD_SLOT if its op_slot is outside the table. */
extern "C" __global__ void gpuos_run_batch(const GpuosTask* tasks, int ntasks, int* status,
                                           unsigned int* next) {
  __shared__ unsigned int ticket;
  for (;;) {
    if (threadIdx.x == 0) ticket = atomicAdd(next, 1u);
    __syncthreads();
    /* Thread 0 rewrites ticket only after the barrier below, when every thread has read it. */
    const unsigned int i = ticket;
    if (static_cast<long long>(i) >= ntasks) return;
    const GpuosTask* t = tasks + i;
    const int slot = t->op_slot;
    const bool valid = slot >= 0 && slot < gpuos_jump_table_size;
    if (valid) gpuos_jump_table[slot](t);
    __syncthreads();
    if (threadIdx.x == 0) {
      /* The block's output writes become visible before the status that announces them. */
      __threadfence();
      status[i] = valid ? GPUOS_STATUS_DONE : GPUOS_STATUS_BAD_SLOT;
    }
  }
}
