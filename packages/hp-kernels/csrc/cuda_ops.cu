// CUDA kernels of hp_kernels: a reduction over several device pointers (the peers' symmetric
// buffers, reachable over NVLink), accumulating in float32. Enqueued on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common.h"

namespace hpk {
namespace {

constexpr int kMaxSrcs = 16;
struct Srcs { const void* p[kMaxSrcs]; };

template <class T> __device__ __forceinline__ float ld(const T* p, size_t i);
template <> __device__ __forceinline__ float ld<float>(const float* p, size_t i) { return p[i]; }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, size_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float ld<__half>(const __half* p, size_t i) {
  return __half2float(p[i]);
}
template <class T> __device__ __forceinline__ void st(T* p, size_t i, float v);
template <> __device__ __forceinline__ void st<float>(float* p, size_t i, float v) { p[i] = v; }
template <> __device__ __forceinline__ void st<__nv_bfloat16>(__nv_bfloat16* p, size_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ void st<__half>(__half* p, size_t i, float v) {
  p[i] = __float2half_rn(v);
}

template <class D, class S>
__global__ void reduce_kernel(D* dst, Srcs srcs, int nsrc, size_t n, int op, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float acc = ld<S>(static_cast<const S*>(srcs.p[0]), i);
    for (int k = 1; k < nsrc; ++k) {
      float v = ld<S>(static_cast<const S*>(srcs.p[k]), i);
      acc = (op == MAX) ? ((v > acc || v != v) ? v : acc) : acc + v;  // NaN wins, as torch
    }
    if (op == AVG) acc *= scale;
    st<D>(dst, i, acc);
  }
}

// 16-byte packs: every source and the destination read/written with one vector access per
// thread per pack (8 bf16, 4 float); peers' buffers are read over NVLink this way.
template <class T, int V> struct alignas(sizeof(T) * V) Pack { T x[V]; };

template <class D, class S, int V>
__global__ void reduce_vec_kernel(D* dst, Srcs srcs, int nsrc, size_t npacks, int op, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < npacks;
       i += (size_t)gridDim.x * blockDim.x) {
    float acc[V];
    Pack<S, V> p = static_cast<const Pack<S, V>*>(srcs.p[0])[i];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = ld<S>(p.x, j);
    for (int k = 1; k < nsrc; ++k) {
      Pack<S, V> q = static_cast<const Pack<S, V>*>(srcs.p[k])[i];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float v = ld<S>(q.x, j);
        acc[j] = (op == MAX) ? ((v > acc[j] || v != v) ? v : acc[j]) : acc[j] + v;
      }
    }
    Pack<D, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) st<D>(out.x, j, op == AVG ? acc[j] * scale : acc[j]);
    reinterpret_cast<Pack<D, V>*>(dst)[i] = out;
  }
}

__global__ void copy_kernel(uint4* dst, const uint4* src, size_t n16) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

template <class D, class S>
cudaError_t launch(uintptr_t dst, const Srcs& s, int nsrc, size_t n, int op, float scale,
                   cudaStream_t stream) {
  constexpr int V = 16 / sizeof(S);
  bool aligned = (dst % (sizeof(D) * V)) == 0;
  for (int k = 0; k < nsrc; ++k) aligned = aligned && (reinterpret_cast<uintptr_t>(s.p[k]) % 16 == 0);
  size_t head = 0;
  if (aligned && n >= static_cast<size_t>(V)) {
    size_t npacks = n / V;
    int blocks = static_cast<int>(std::min<size_t>((npacks + 511) / 512, 132 * 4));
    reduce_vec_kernel<D, S, V><<<blocks, 512, 0, stream>>>(reinterpret_cast<D*>(dst), s, nsrc,
                                                          npacks, op, scale);
    head = npacks * V;
  }
  if (head < n) {  // the tail (or everything, when not 16-byte aligned)
    Srcs t = s;
    for (int k = 0; k < nsrc; ++k) t.p[k] = static_cast<const S*>(s.p[k]) + head;
    size_t rest = n - head;
    int blocks = static_cast<int>(std::min<size_t>((rest + 255) / 256, 132 * 8));
    reduce_kernel<D, S><<<blocks, 256, 0, stream>>>(reinterpret_cast<D*>(dst) + head, t, nsrc,
                                                    rest, op, scale);
  }
  return cudaGetLastError();
}

template <class D> cudaError_t by_src(int src_dtype, uintptr_t dst, const Srcs& s, int nsrc,
                                       size_t n, int op, float scale, cudaStream_t st) {
  switch (src_dtype) {
    case F32: return launch<D, float>(dst, s, nsrc, n, op, scale, st);
    case BF16: return launch<D, __nv_bfloat16>(dst, s, nsrc, n, op, scale, st);
    case F16: return launch<D, __half>(dst, s, nsrc, n, op, scale, st);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

std::string cuda_reduce(uintptr_t dst, int dst_dtype, const std::vector<uintptr_t>& srcs,
                        int src_dtype, size_t n, int op, double scale, uintptr_t stream) {
  if (srcs.empty() || srcs.size() > kMaxSrcs)
    return "cuda_reduce takes 1 to " + std::to_string(kMaxSrcs) + " sources";
  Srcs s{};
  for (size_t k = 0; k < srcs.size(); ++k) s.p[k] = reinterpret_cast<const void*>(srcs[k]);
  auto st = reinterpret_cast<cudaStream_t>(stream);
  int nsrc = static_cast<int>(srcs.size());
  cudaError_t err;
  switch (dst_dtype) {
    case F32: err = by_src<float>(src_dtype, dst, s, nsrc, n, op, (float)scale, st); break;
    case BF16: err = by_src<__nv_bfloat16>(src_dtype, dst, s, nsrc, n, op, (float)scale, st); break;
    case F16: err = by_src<__half>(src_dtype, dst, s, nsrc, n, op, (float)scale, st); break;
    default: return "cuda_reduce supports float32, bfloat16 and float16";
  }
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

std::string cuda_copy(uintptr_t dst, uintptr_t src, size_t nbytes, int blocks, uintptr_t stream) {
  auto st = reinterpret_cast<cudaStream_t>(stream);
  if (nbytes == 0) return std::string();
  if (dst % 16 || src % 16 || nbytes % 16) {
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src),
                                      nbytes, cudaMemcpyDefault, st);
    return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
  }
  size_t n16 = nbytes / 16;
  int b = static_cast<int>(std::min<size_t>((n16 + 511) / 512, static_cast<size_t>(blocks)));
  copy_kernel<<<b, 512, 0, st>>>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), n16);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace hpk
