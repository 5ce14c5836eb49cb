/* gpuos_worker.cu: the leased persistent worker (DESIGN.md, runtime protocol 1-4).
 *
 * One block per SM (the host picks the grid) polls the device-memory queue: it claims the next
 * published record by compare-and-swap on `head` (so a ticket is only ever taken for a record
 * that exists: nothing is claimed and then abandoned), copies the claimed descriptors into shared
 * memory, runs each record's operator through the image's jump table with all its threads, and writes
 * completion to mapped host memory. A block exits when the queue has been empty for `idle_ns`,
 * when the host sets `stop` and the queue is empty, or after `lease_ns` in total; the host
 * relaunches the worker when records are pending, so any implicit device sync waits at most one
 * lease and module loads can run between leases.
 *
 * Memory: descriptors and tensors are read with L1-bypassing loads (ld.global.cg): within one
 * long-lived launch an SM's L1 is never invalidated, and ring slots and torch's reused buffers
 * change under it. */
#include "gpuos_device.cuh"

extern "C" __device__ GpuosOpFn gpuos_jump_table[];
extern "C" __device__ int gpuos_jump_table_size;

__device__ __forceinline__ unsigned long long gpuos_now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long gpuos_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/* Records one block claims at once when many are waiting. Each claim is a compare-and-swap on one
 * word that all blocks contend for: 10k one-record tasks in claims of ~3 spent most of a
 * millisecond serialised on it, so claim a fair share up to 16 (load balance costs at most 16
 * records of one block's time at the end). */
#define GPUOS_MAX_CLAIM 16

/* Claims the next published records for this block: sets *first and returns how many (at least
 * one), or returns 0 when the block should exit. Thread 0 only. Taking several at once when the
 * queue is long keeps 132 blocks from serialising on one compare-and-swap per record. */
__device__ int gpuos_claim(GpuosQueue* q, unsigned long long started, unsigned long long idle_since,
                           unsigned long long idle_ns, unsigned long long lease_ns,
                           long long* first) {
  for (;;) {
    const unsigned long long now = gpuos_now_ns();
    if (now - started > lease_ns) return 0;
    const unsigned long long tail = gpuos_acquire(&q->tail);
    const unsigned long long head = *reinterpret_cast<volatile unsigned long long*>(&q->head);
    if (head < tail) {
      const unsigned long long share = (tail - head) / gridDim.x;
      const int take = static_cast<int>(share < 1 ? 1 : (share > GPUOS_MAX_CLAIM ? GPUOS_MAX_CLAIM : share));
      if (atomicCAS(&q->head, head, head + take) == head) {
        *first = static_cast<long long>(head);
        return take;
      }
      continue;
    }
    if (*reinterpret_cast<volatile unsigned long long*>(&q->stop) || now - idle_since > idle_ns) return 0;
    __nanosleep(256);
  }
}

/* Copies the descriptors of records first..first+n-1 into shared memory with all threads of the
 * block: one round of loads in flight for all of them, instead of one load latency per record
 * (the operator then reads its descriptor many times, from shared memory). */
__device__ void gpuos_fetch(const GpuosTask* ring, unsigned long long mask, long long first, int n,
                            GpuosTask* tasks) {
  const unsigned int words = sizeof(GpuosTask) / 4;
  for (unsigned int i = threadIdx.x; i < n * words; i += blockDim.x) {
    const unsigned int* src = reinterpret_cast<const unsigned int*>(ring + ((first + i / words) & mask));
    reinterpret_cast<unsigned int*>(tasks + i / words)[i % words] = gpuos_ld_u32(src + i % words);
  }
  __syncthreads();
}

/* Runs one fetched record with all threads of the block. Returns whether its op_slot was valid. */
__device__ bool gpuos_run(const GpuosTask* task) {
  const int slot = task->op_slot;
  const bool valid = slot >= 0 && slot < gpuos_jump_table_size;
  if (valid) gpuos_jump_table[slot](task);
  __syncthreads(); /* operators reuse static shared memory: the next one starts after this one */
  return valid;
}

/* Drain the queue until idle, stopped or out of lease. ring has mask + 1 slots; done[slot] is set
 * to ticket + 1 once the record's operator finished (its writes fenced), or to -(ticket + 1) when
 * its op_slot is not in this image's jump table. */
extern "C" __global__ void gpuos_worker(GpuosQueue* q, const GpuosTask* ring, unsigned long long mask,
                                        volatile long long* done, unsigned long long idle_ns,
                                        unsigned long long lease_ns) {
  __shared__ GpuosTask tasks[GPUOS_MAX_CLAIM];
  __shared__ long long first;
  __shared__ int count;
  const unsigned long long started = gpuos_now_ns();
  unsigned long long idle_since = started;
  for (;;) {
    if (threadIdx.x == 0) count = gpuos_claim(q, started, idle_since, idle_ns, lease_ns, &first);
    __syncthreads();
    const int n = count;
    const long long t0 = first;
    if (n == 0) return;
    gpuos_fetch(ring, mask, t0, n, tasks);
    unsigned int invalid = 0; /* bit k: record t0 + k had a bad slot (thread 0's copy is used) */
    for (int k = 0; k < n; ++k) invalid |= gpuos_run(tasks + k) ? 0u : 1u << k;
    if (threadIdx.x == 0) {
      __threadfence_system(); /* outputs visible before the completions that announce them */
      for (int k = 0; k < n; ++k) {
        const long long t = t0 + k;
        done[t & mask] = (invalid >> k) & 1u ? -(t + 1) : t + 1;
      }
      idle_since = gpuos_now_ns();
    }
    __syncthreads(); /* `count`, `first` and `tasks` are rewritten only after everyone read them */
  }
}
/* Stream-ordered 64-bit store, for devices without cuStreamWriteValue64: `*p = v` with release
 * semantics, so everything before it in the stream is visible first. */
extern "C" __global__ void gpuos_write_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
