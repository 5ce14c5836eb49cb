/* linear_call.cu: where a linear record's time goes outside the worker, and what the call through
 * the jump table costs it. One block of 256 threads a record (K unsplit: one 64-output tile, the
 * catalogue's plan at decode M), each block running its record `reps` times in turn with W
 * rotating over `copies` buffers (24 x GPT-2's QKV = 85 MB: W streams from HBM as in a step),
 * with the operator's trace marks (GPUOS_MARK, globaltimer). Prints the time a rep and the median
 * of each mark from the record's start. The operator is reached the way the build says:
 *   default          the catalogue's operator (GPUOS_OPERATOR: it reads the task with shared-memory
 *                    loads) through a table of device function pointers, as the worker calls it;
 *   -DINLINE_GENERIC inlined into the kernel, the task behind a pointer the compiler cannot see
 *                    into (it reads the task with generic loads, as operators did before
 *                    GPUOS_OPERATOR);
 *   -DINLINE         inlined, the task a __shared__ object (shared-memory loads).
 * CARVEOUT=<percent> in the environment sets the kernel's preferred shared-memory carveout.
 *
 * Built and run on a CUDA machine (bench/NOTES.md quotes its output); -arch=sm_90a builds the
 * 64-row m-blocks on warpgroup products as the runtime does on an H100/H200, sm_90 on mma.sync:
 *   nvcc -arch=sm_90a -rdc=true -std=c++17 -maxrregcount=128 -Icuda -o /tmp/linear_call \
 *     bench/linear_call.cu && /tmp/linear_call M N K [reps=200] [copies=24] */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define GPUOS_TRACE 1
#include "ops/linear.cuh"

extern "C" {
__device__ unsigned long long gpuos_trace[GPUOS_TRACE_SLOTS][4];
__device__ unsigned long long gpuos_trace_marks[GPUOS_TRACE_SLOTS][GPUOS_TRACE_MARKS];
__device__ long long gpuos_trace_ticket[GPUOS_TRACE_SMS];
}

namespace {

constexpr int kThreads = 256;
constexpr int kSkip = 5;  // reps left out of the medians (cold caches)

#if !defined(INLINE_GENERIC) && !defined(INLINE)
GPUOS_DEFINE_LINEAR(linear_op)  // the catalogue's operator, as the worker's image defines it
__device__ GpuosOpFn table[1] = {linear_op};
#endif

__global__ void run(const GpuosTask* tasks, int records, int reps) {
  __shared__ GpuosTask t;
  for (int r = 0; r < reps; ++r) {
    const long long slot = static_cast<long long>(r) * records + blockIdx.x;
    const GpuosTask* src = tasks + slot;
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(GpuosTask) / 4); i += blockDim.x)
      reinterpret_cast<int*>(&t)[i] = reinterpret_cast<const int*>(src)[i];
    if (threadIdx.x == 0) {
      gpuos_trace_ticket[gpuos_smid()] = slot;
      gpuos_trace[slot & (GPUOS_TRACE_SLOTS - 1)][1] = gpuos_now_ns();
    }
    __syncthreads();
#if defined(INLINE_GENERIC)
    const GpuosTask* opaque = &t;
    asm volatile("mov.b64 %0, %0;" : "+l"(opaque));
    gpuos_linear<false, GPUOS_LINEAR_IDENTITY>(opaque);
#elif defined(INLINE)
    gpuos_linear<false, GPUOS_LINEAR_IDENTITY>(&t);
#else
    table[0](&t);
#endif
    __syncthreads();
    if (threadIdx.x == 0) gpuos_trace[slot & (GPUOS_TRACE_SLOTS - 1)][3] = gpuos_now_ns();
  }
}

GpuosTensorRef ref(void* data, int dtype, std::vector<long long> sizes) {
  GpuosTensorRef r = {};
  r.data = reinterpret_cast<uint64_t>(data);
  r.dtype = dtype;
  r.ndim = static_cast<int>(sizes.size());
  for (int d = 0; d < GPUOS_MAX_DIMS; ++d) r.sizes[d] = 1;
  long long stride = 1;
  for (int d = r.ndim - 1; d >= 0; --d) r.sizes[d] = sizes[d], r.strides[d] = stride, stride *= sizes[d];
  r.numel = stride;
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return -1.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s M N K [reps] [copies]\n", argv[0]);
    return 2;
  }
  const int m = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]);
  const int reps = argc > 4 ? atoi(argv[4]) : 200, copies = argc > 5 ? atoi(argv[5]) : 24;
  const int records = (n + GPUOS_LINEAR_BN - 1) / GPUOS_LINEAR_BN * ((m + GPUOS_LINEAR_BM - 1) / GPUOS_LINEAR_BM);
  const size_t wbytes = static_cast<size_t>(n) * k * 2;
  char *w, *x, *bias, *out;
  cudaMalloc(&w, wbytes * copies);
  cudaMalloc(&x, static_cast<size_t>(m) * k * 2);
  cudaMalloc(&bias, n * 2);
  cudaMalloc(&out, static_cast<size_t>(m) * n * 2);
  cudaMemset(w, 0, wbytes * copies);
  cudaMemset(x, 0, static_cast<size_t>(m) * k * 2);
  cudaMemset(bias, 0, n * 2);
  std::vector<GpuosTask> tasks(static_cast<size_t>(reps) * records);
  for (int r = 0; r < reps; ++r)
    for (int i = 0; i < records; ++i) {
      GpuosTask& t = tasks[static_cast<size_t>(r) * records + i];
      memset(&t, 0, sizeof t);
      t.num_inputs = 4;
      t.signal = t.wait[0] = t.wait[1] = GPUOS_NO_EVENT;
      t.range_begin = i;
      t.range_end = i + 1;
      t.in[0] = ref(x, GPUOS_DTYPE_F16, {m, k});
      t.in[1] = ref(w + static_cast<size_t>(r % copies) * wbytes, GPUOS_DTYPE_F16, {n, k});
      t.in[2] = ref(bias, GPUOS_DTYPE_F16, {n});
      t.in[3] = ref(out, GPUOS_DTYPE_I32, {0});
      t.out = ref(out, GPUOS_DTYPE_F16, {m, n});
    }
  GpuosTask* device_tasks;
  cudaMalloc(&device_tasks, tasks.size() * sizeof(GpuosTask));
  cudaMemcpy(device_tasks, tasks.data(), tasks.size() * sizeof(GpuosTask), cudaMemcpyHostToDevice);
  cudaFuncSetAttribute(run, cudaFuncAttributeMaxDynamicSharedMemorySize, GPUOS_DYNAMIC_SMEM);
  if (const char* carveout = getenv("CARVEOUT"))
    cudaFuncSetAttribute(run, cudaFuncAttributePreferredSharedMemoryCarveout, atoi(carveout));
  run<<<records, kThreads, GPUOS_DYNAMIC_SMEM>>>(device_tasks, records, 3);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  run<<<records, kThreads, GPUOS_DYNAMIC_SMEM>>>(device_tasks, records, reps);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  printf("M=%d N=%d K=%d records=%d reps=%d: %.2f us a rep (%s)\n", m, n, k, records, reps,
         1000 * ms / reps, cudaGetErrorString(cudaGetLastError()));
  static unsigned long long trace[GPUOS_TRACE_SLOTS][4], marks[GPUOS_TRACE_SLOTS][GPUOS_TRACE_MARKS];
  cudaMemcpyFromSymbol(trace, gpuos_trace, sizeof trace);
  cudaMemcpyFromSymbol(marks, gpuos_trace_marks, sizeof marks);
  std::vector<double> done, waited, at[GPUOS_TRACE_MARKS];
  for (int r = kSkip; r < reps; ++r)
    for (int i = 0; i < records; ++i) {
      const long long s = (static_cast<long long>(r) * records + i) & (GPUOS_TRACE_SLOTS - 1);
      const double start = static_cast<double>(trace[s][1]);
      done.push_back((trace[s][3] - start) / 1000);
      waited.push_back((trace[s][2] - start) / 1000);
      for (int j = 0; j < GPUOS_TRACE_MARKS; ++j)
        if (marks[s][j]) at[j].push_back((marks[s][j] - start) / 1000);
    }
  // linear.cuh's marks: 0 plan, 6 W's first stages issued, 2 first stage in, 3 products, 1 stored
  printf("  us from the start: plan %.2f, W issued %.2f, wait met %.2f, first stage in %.2f, "
         "products %.2f, stored %.2f, done %.2f\n",
         median(at[0]), median(at[6]), median(waited), median(at[2]), median(at[3]), median(at[1]),
         median(done));
  return 0;
}
