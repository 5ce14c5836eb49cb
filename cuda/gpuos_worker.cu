/* gpuos_worker.cu: the leased persistent worker (docs/DESIGN.md, runtime protocol 1-4).
 *
 * One block per SM (the host picks the grid) polls the device-memory queue: it takes a ticket for
 * the next record with one atomicAdd on `head` (see gpuos_claim), copies the claimed descriptors
 * into shared memory, runs each record's operator through the image's jump table with all its
 * threads, and writes completion to mapped host memory. A block exits when the queue has been
 * empty for `idle_ns`, when the host sets `stop` and the queue is empty, or after `lease_ns` in
 * total; the host relaunches the worker when records are pending, so any implicit device sync
 * waits at most one lease (plus idle_ns, see gpuos_claim) and module loads can run between leases.
 *
 * Memory: descriptors and tensors are read with L1-bypassing loads (ld.global.cg): within one
 * long-lived launch an SM's L1 is never invalidated, and ring slots and torch's reused buffers
 * change under it.
 *
 * Dependencies (device programs, see gpuos_abi.h): before a record runs, thread 0 waits until each
 * event it names has reached its count (or its operator waits itself, GPUOS_TASK_EARLY); once its
 * last write is behind a barrier, thread 0 adds one to the event it signals with a release (the
 * operator does, GPUOS_OPERATOR, or the worker when no operator ran). Why waiting cannot
 * deadlock:
 *   - tickets are taken strictly in order (atomicAdd on head; only unpublished tickets are ever
 *     given back, from the top), and a record only waits for events signalled by records with
 *     smaller tickets (the host builds programs that way), so every record a claimed record waits
 *     for is itself already claimed;
 *   - a block runs its claimed records in ticket order and never exits while it holds one (it
 *     exits only from gpuos_claim, between claims, or while holding tickets not yet published,
 *     which it gives back first): lease and idle limits end a block only there;
 *   - claims are made only by blocks that are running, and a running block stays resident.
 * So the unfinished record with the smallest ticket waits for nothing unfinished: it is claimed,
 * its block is running it or the finished records before it, and it completes. By induction, all
 * claimed records complete, whatever the grid size and however many blocks are resident. Records
 * published later (a program larger than the ring goes in as space frees) only wait for earlier
 * ones, and unclaimed ones are taken by the next lease's launch. */
#include "gpuos_device.cuh"

extern "C" __device__ GpuosOpFn gpuos_jump_table[];

#ifdef GPUOS_TRACE
extern "C" { /* the definitions of gpuos_device.cuh's diagnostics tables */
__device__ unsigned long long gpuos_trace[GPUOS_TRACE_SLOTS][4];
__device__ unsigned long long gpuos_trace_marks[GPUOS_TRACE_SLOTS][GPUOS_TRACE_MARKS];
__device__ long long gpuos_trace_ticket[GPUOS_TRACE_SMS];
}
__device__ __forceinline__ void gpuos_trace_at(long long ticket, int field, unsigned long long v) {
  if (threadIdx.x == 0) gpuos_trace[ticket & (GPUOS_TRACE_SLOTS - 1)][field] = v;
}
#define GPUOS_TRACE_AT(ticket, field, value) gpuos_trace_at(ticket, field, value)
#else
#define GPUOS_TRACE_AT(ticket, field, value) ((void)0)
#endif
extern "C" __device__ int gpuos_jump_table_size;

__device__ __forceinline__ unsigned long long gpuos_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/* Most records one block claims at once when many are waiting (the queue's `claim` may be lower):
 * a fair share of the published records up to this. Records of a claim run one after the other,
 * so while dependent programs are queued the host asks for claims of one (parallel tasks then
 * spread over every block). */
#define GPUOS_MAX_CLAIM 16

/* Whether the block's tickets [t, t + n) may be given back: no later ticket was taken, so
 * setting head back to t leaves no gap. */
__device__ __forceinline__ bool gpuos_give_back(GpuosQueue* q, unsigned long long t, int n) {
  return atomicCAS(&q->head, t + n, t) == t + n;
}

/* Whether the block's tickets [t, t + n) are published: waits for the host to publish them and
 * returns the tail it saw (> t), or, when stopped or idle for `idle_ns`, gives them back once no
 * later ticket exists (the blocks holding unpublished tickets give theirs back from the highest
 * down) and returns 0. Thread 0 only. */
__device__ unsigned long long gpuos_published(GpuosQueue* q, unsigned long long t, int n,
                                              unsigned long long idle_ns) {
  const unsigned long long waiting = gpuos_now_ns();
  for (;;) {
    const unsigned long long tail = gpuos_acquire(&q->tail);
    if (tail >= t + n) return tail;
    const bool stop = *reinterpret_cast<volatile unsigned long long*>(&q->stop);
    if ((stop || gpuos_now_ns() - waiting > idle_ns) && gpuos_give_back(q, t, n)) return 0;
    __nanosleep(256);
  }
}

/* What thread 0 of a block learnt at its last look at the queue: every ticket below `tail` is
 * published (its acquire load saw that tail, so those descriptors are visible to it), the block's
 * last claim ended at ticket `next`, and the queue asked for claims of one record (`single`: a
 * program is being published). */
struct GpuosSeen {
  unsigned long long tail;
  unsigned long long next;
  bool single;
};

/* Claims records for this block: sets *first and returns how many (at least one), or returns 0
 * when the block should exit. Thread 0 only.
 * A ticket is one atomicAdd on `head`: all blocks get theirs in one round trip to L2 (claims by
 * compare-and-swap succeeded one per round trip, ~0.45 us each under contention, which bounded a
 * decode step of ~4000 records to ~1.8 ms). Claiming one record while the last look saw records
 * left, the block takes its ticket without looking again: looking (the tail, then head and the
 * claim limit, then the add) took three round trips, and a block took 2-8 us from a program
 * record's end to its next claim while the weights stream (bench/NOTES.md). A ticket may run
 * past `tail` (other blocks took the last published records since the look): the block then
 * waits for it to be published (gpuos_published) and exits if it is given back. */
__device__ int gpuos_claim(GpuosQueue* q, GpuosSeen& seen, unsigned long long started,
                           unsigned long long idle_since, unsigned long long idle_ns,
                           unsigned long long lease_ns, long long* first) {
  for (;;) {
    const unsigned long long now = gpuos_now_ns();
    if (now - started > lease_ns) return 0;
    int take = 1;
    unsigned long long t;
    if (seen.single && seen.next < seen.tail) {
      t = atomicAdd(&q->head, 1ull);
    } else {
      const unsigned long long tail = gpuos_acquire(&q->tail);
      const unsigned long long head = *reinterpret_cast<volatile unsigned long long*>(&q->head);
      const unsigned long long max_claim = *reinterpret_cast<volatile unsigned long long*>(&q->claim);
      seen = GpuosSeen{tail, head, max_claim == 1};
      if (head >= tail) {
        if (*reinterpret_cast<volatile unsigned long long*>(&q->stop) || now - idle_since > idle_ns)
          return 0;
        __nanosleep(256);
        continue;
      }
      const unsigned long long share = (tail - head) / gridDim.x;
      take = static_cast<int>(share < 1 ? 1 : (share > max_claim ? max_claim : share));
      t = atomicAdd(&q->head, static_cast<unsigned long long>(take));
    }
    *first = static_cast<long long>(t);
    seen.next = t + take;
    if (seen.next <= seen.tail) return take;
    seen.tail = gpuos_published(q, t, take, idle_ns);
    return seen.tail == 0 ? 0 : take;
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

/* What thread 0 of a block knows of one event without asking memory: its counter has reached at
 * least `count`. Learnt from its own signals and from what its waits observed; reset at each
 * claim, because a program's counters are zeroed between runs and a claim never holds records of
 * two runs of one program (the host publishes a run only after the previous one completed). */
struct GpuosKnown {
  unsigned long long events;
  int event;
  unsigned int count;

  __device__ __forceinline__ bool covers(unsigned long long e, int k, unsigned int n) const {
    return events == e && event == k && count >= n;
  }

  /* `task` has signalled its event (gpuos_signal): its counter has one more. */
  __device__ __forceinline__ void signalled(const GpuosTask* task) {
    if (!gpuos_signals(task)) return;
    const bool same = events == task->events && event == task->signal;
    *this = GpuosKnown{task->events, task->signal, same ? count + 1 : 1u};
  }
};

/* Blocks until every event `task` waits for has reached its count (gpuos_poll_events; the
 * barrier then orders every other thread's loads after thread 0's observation, as a grid barrier
 * does). Tasks read their inputs with L1-bypassing loads, so no stale line can be served. A wait
 * `known` already covers (a producer earlier in this block's claim) costs no load. */
__device__ __forceinline__ void gpuos_wait_events(const GpuosTask* task, GpuosKnown& known) {
  if (task->events == 0) return; /* uniform over the block: the task is in shared memory */
  if (threadIdx.x == 0) {
    bool need[GPUOS_MAX_WAITS];
#pragma unroll
    for (int k = 0; k < GPUOS_MAX_WAITS; ++k)
      need[k] = task->wait[k] != GPUOS_NO_EVENT &&
                !known.covers(task->events, task->wait[k], task->wait_count[k]);
    const unsigned int seen = gpuos_poll_events(task, need);
    if (need[0]) known = GpuosKnown{task->events, task->wait[0], seen};
  }
  __syncthreads();
}

/* Runs one fetched record with all threads of the block: waits for its events (or lets its
 * operator wait: GPUOS_TASK_EARLY), runs its operator (none for GPUOS_OP_NOP), which signals its
 * event (GPUOS_OPERATOR), or signals it here when none ran. Returns whether its op_slot was
 * valid. A record with a bad slot still waits and signals, so records that wait for it fail with
 * it instead of hanging. `known` is thread 0's. */
__device__ bool gpuos_run(const GpuosTask* task, long long ticket, GpuosKnown& known) {
  __builtin_assume(__isShared(task)); /* tasks + k of gpuos_worker: shared-memory loads */
#ifdef GPUOS_TRACE
  if (threadIdx.x == 0) gpuos_trace_ticket[gpuos_smid()] = ticket; /* GPUOS_MARK, gpuos_await */
#endif
  const int slot = task->op_slot;
  const bool valid = slot == GPUOS_OP_NOP || (slot >= 0 && slot < gpuos_jump_table_size);
  const bool runs = valid && slot != GPUOS_OP_NOP;
  if (!runs || !(task->flags & GPUOS_TASK_EARLY)) {
    gpuos_wait_events(task, known);
    GPUOS_TRACE_AT(ticket, 2, gpuos_now_ns());
  }
  if (runs) {
    gpuos_jump_table[slot](task);
  } else if (threadIdx.x == 0) {
    gpuos_signal(task);
  }
  __syncthreads(); /* operators reuse static shared memory: the next one starts after this one */
  if (threadIdx.x == 0) known.signalled(task);
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
  GpuosSeen seen = {0ull, 0ull, false}; /* thread 0's */
  for (;;) {
    if (threadIdx.x == 0)
      count = gpuos_claim(q, seen, started, idle_since, idle_ns, lease_ns, &first);
    __syncthreads();
    const int n = count;
    const long long t0 = first;
    if (n == 0) return;
#ifdef GPUOS_TRACE
    const unsigned long long sm = gpuos_smid();
    for (int k = 0; k < n; ++k) {
      GPUOS_TRACE_AT(t0 + k, 0, (sm << 48) | (t0 + k + 1));
      GPUOS_TRACE_AT(t0 + k, 1, gpuos_now_ns());
    }
#endif
    gpuos_fetch(ring, mask, t0, n, tasks);
    unsigned int invalid = 0; /* bit k: record t0 + k had a bad slot (thread 0's copy is used) */
    GpuosKnown known = {0ull, GPUOS_NO_EVENT, 0u};
    for (int k = 0; k < n; ++k) invalid |= gpuos_run(tasks + k, t0 + k, known) ? 0u : 1u << k;
    if (threadIdx.x == 0) {
      /* outputs visible before the completions that announce them. A LOCAL record's are
       * announced by the completion of a later record that waits for it (the fence is
       * cumulative): fenced after every record of a program, a block took 2-8 us from one
       * record's end to its next claim while the weights stream (bench/NOTES.md) */
      bool publish = false;
      for (int k = 0; k < n; ++k) publish = publish || !(tasks[k].flags & GPUOS_TASK_LOCAL);
      if (publish) __threadfence_system();
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
