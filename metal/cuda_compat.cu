// Shared helpers for the CUDA twins (prepended to each twin's header by
// launch.py). Warp reductions use the same xor-butterfly (1,2,4,8,16) as
// the Linux emulator's simd_sum.
typedef unsigned int uint;
namespace mtl {
__device__ __forceinline__ float exp(float x) { return expf(x); }
__device__ __forceinline__ float log(float x) { return logf(x); }
__device__ __forceinline__ float abs(float x) { return fabsf(x); }
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float rsqrt_precise(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }
}  // namespace mtl
__device__ __forceinline__ float warp_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}
