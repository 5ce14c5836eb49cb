/* math.cuh: the fp32 math functions of the operator expression language.
 *
 * gpuos_core/mathlib.py lists every function here with its argument count, defaults and torch
 * reference; the parser fills in defaults, so every function takes all of its arguments. Semantics
 * follow torch's fp32 kernels, NaN propagation included: torch.maximum/minimum/clamp return NaN when
 * any operand is NaN, which fmaxf/fminf would drop. Only NVRTC builtins: no headers. */
#pragma once

__device__ __forceinline__ float gpuos_max(float x, float y) {
  return (x != x || y != y) ? x + y : fmaxf(x, y); /* x + y is NaN when either is */
}
__device__ __forceinline__ float gpuos_min(float x, float y) {
  return (x != x || y != y) ? x + y : fminf(x, y);
}
/* lo > hi gives hi, as torch.clamp does. */
__device__ __forceinline__ float gpuos_clamp(float x, float lo, float hi) {
  return gpuos_min(gpuos_max(x, lo), hi);
}
__device__ __forceinline__ float gpuos_clamp_min(float x, float lo) { return gpuos_max(x, lo); }
__device__ __forceinline__ float gpuos_clamp_max(float x, float hi) { return gpuos_min(x, hi); }
__device__ __forceinline__ float gpuos_hardtanh(float x, float lo, float hi) {
  return gpuos_clamp(x, lo, hi);
}

__device__ __forceinline__ float gpuos_neg(float x) { return -x; }
__device__ __forceinline__ float gpuos_reciprocal(float x) { return 1.0f / x; }
__device__ __forceinline__ float gpuos_abs(float x) { return fabsf(x); }
__device__ __forceinline__ float gpuos_exp(float x) { return expf(x); }
__device__ __forceinline__ float gpuos_log(float x) { return logf(x); }
__device__ __forceinline__ float gpuos_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float gpuos_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float gpuos_sin(float x) { return sinf(x); }
__device__ __forceinline__ float gpuos_cos(float x) { return cosf(x); }
__device__ __forceinline__ float gpuos_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float gpuos_erf(float x) { return erff(x); }
__device__ __forceinline__ float gpuos_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ float gpuos_where(float c, float x, float y) { return c != 0.0f ? x : y; }

/* relu keeps NaN, as torch.relu does. */
__device__ __forceinline__ float gpuos_relu(float x) { return (x > 0.0f || x != x) ? x : 0.0f; }
__device__ __forceinline__ float gpuos_leaky_relu(float x, float slope) {
  return x > 0.0f ? x : x * slope;
}
__device__ __forceinline__ float gpuos_elu(float x, float alpha) {
  return x > 0.0f ? x : alpha * expm1f(x);
}
/* torch: linear above the threshold, where log1p(exp(.)) would overflow. */
__device__ __forceinline__ float gpuos_softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}
__device__ __forceinline__ float gpuos_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float gpuos_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gpuos_hardsigmoid(float x) {
  return gpuos_clamp(x + 3.0f, 0.0f, 6.0f) / 6.0f;
}
__device__ __forceinline__ float gpuos_hardswish(float x) { return x * gpuos_hardsigmoid(x); }
/* 0.70710678f = 1/sqrt(2) */
__device__ __forceinline__ float gpuos_gelu(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
/* torch approximate='tanh'; 0.79788456f = sqrt(2/pi) */
__device__ __forceinline__ float gpuos_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}
