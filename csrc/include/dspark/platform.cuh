// dspark/platform.cuh: what a kernel template needs from the platform, the same on both sides.
//
// nvcc (the GPU build, csrc/torch and csrc/capi): the CUDA runtime.
// DSPARK_SIMT (the host build that runs the kernels on the CPU, csrc/simt): the SIMT runtime, which implements the
// built-ins, barriers, warp collectives and atomics on fibers and counts global traffic.
//
// Conventions every kernel follows, so that both builds run the same code and the harness sees what it moves:
//   * global memory is read with dspark::ldg (or load_vec / __ldg) and written with dspark::stg (or store_vec /
//     atomics), never by a plain dereference: those are what the byte counters count;
//   * shared memory is declared with DSPARK_SHARED(T, name), DSPARK_SHARED_ARRAY(T, name, n) or
//     DSPARK_DYNAMIC_SMEM(T, name) (the SIMT build rejects a raw __shared__);
//   * kernels are launched with dspark::launch (never <<<>>>), so grid, block, shared memory and cooperative-ness
//     are decided by the same launch code on both sides;
//   * a persistent kernel synchronises its grid with dspark::grid_sync() inside a cooperative launch.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#if defined(DSPARK_SIMT)
#include "dspark_simt/runtime.h"
#else
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#if defined(__CUDACC__) || defined(DSPARK_SIMT)
#define DSPARK_DEVICE __device__ __forceinline__
#define DSPARK_HOST_DEVICE_FN __host__ __device__ __forceinline__
#else
#define DSPARK_DEVICE inline
#define DSPARK_HOST_DEVICE_FN inline
#endif

#define DSPARK_CONCAT_INNER(a, b) a##b
#define DSPARK_CONCAT(a, b) DSPARK_CONCAT_INNER(a, b)

#if defined(DSPARK_SIMT)
// One allocation per call site and block, from the block's (poisoned) shared-memory arena.
#define DSPARK_SHARED_ARRAY(T, name, n)                                                              \
  static const char DSPARK_CONCAT(dspark_smem_site_, __LINE__) = 0;                                 \
  T* name = static_cast<T*>(::dspark::simt::shared_alloc(&DSPARK_CONCAT(dspark_smem_site_, __LINE__), \
                                                         sizeof(T) * (n), alignof(T)))
#define DSPARK_SHARED(T, name)                                                                         \
  static const char DSPARK_CONCAT(dspark_smem_site_, __LINE__) = 0;                                   \
  T& name = *static_cast<T*>(::dspark::simt::shared_alloc(&DSPARK_CONCAT(dspark_smem_site_, __LINE__), \
                                                          sizeof(T), alignof(T)))
#define DSPARK_DYNAMIC_SMEM(T, name) T* name = static_cast<T*>(::dspark::simt::dynamic_smem())
#else
#define DSPARK_SHARED_ARRAY(T, name, n) __shared__ T name[n]
#define DSPARK_SHARED(T, name) __shared__ T name
#define DSPARK_DYNAMIC_SMEM(T, name)                                         \
  extern __shared__ __align__(16) unsigned char dspark_dynamic_smem_raw_[]; \
  T* name = reinterpret_cast<T*>(dspark_dynamic_smem_raw_)
#endif

namespace dspark {

// ------------------------------------------------------------------------------------------------ memory
// Global loads and stores. On the GPU, loads use the read-only path (__ldg) word by word for any trivially
// copyable T (a struct of partials included; words as wide as T's alignment allows), stores are plain; in the SIMT
// build both are counted (sizeof(T) bytes per call).
template <typename T>
DSPARK_DEVICE T ldg(const T* p) {
#if defined(DSPARK_SIMT)
  return __ldg(p);
#else
  static_assert(std::is_trivially_copyable<T>::value, "dspark::ldg loads trivially copyable values");
  if constexpr (std::is_arithmetic<T>::value || std::is_same<T, float4>::value || std::is_same<T, uint4>::value ||
                std::is_same<T, int4>::value || std::is_same<T, uint2>::value || std::is_same<T, float2>::value ||
                std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value) {
    return __ldg(p);
  } else {
    using Word = std::conditional_t<alignof(T) % 16 == 0 && sizeof(T) % 16 == 0, uint4,
                 std::conditional_t<alignof(T) % 8 == 0 && sizeof(T) % 8 == 0, uint2,
                 std::conditional_t<alignof(T) % 4 == 0 && sizeof(T) % 4 == 0, unsigned, unsigned char>>>;
    constexpr int kWords = sizeof(T) / sizeof(Word);
    Word w[kWords];
    const Word* src = reinterpret_cast<const Word*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = __ldg(src + i);
    T v;
    memcpy(&v, w, sizeof(T));
    return v;
  }
#endif
}
// A load that must see writes of other blocks made before a grid barrier or a __threadfence + atomic handshake
// (no read-only cache). Structs of whole 32-bit words are read word by word (a volatile struct cannot be copied).
template <typename T>
DSPARK_DEVICE T ld_coherent(const T* p) {
#if defined(DSPARK_SIMT)
  simt::count_read(p, sizeof(T));
  return *p;
#else
  if constexpr (std::is_arithmetic<T>::value) {
    return *const_cast<const volatile T*>(p);
  } else {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) % 4 == 0,
                  "dspark::ld_coherent loads arithmetic values or trivially copyable structs of 32-bit words");
    uint32_t w[sizeof(T) / 4];
    const volatile uint32_t* src = reinterpret_cast<const volatile uint32_t*>(p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) w[i] = src[i];
    T v;
    memcpy(&v, w, sizeof(T));
    return v;
  }
#endif
}
template <typename T>
DSPARK_DEVICE void stg(T* p, T v) {
#if defined(DSPARK_SIMT)
  simt::count_write(p, sizeof(T));
#endif
  *p = v;
}

// ------------------------------------------------------------------------------------------------ launch
struct LaunchConfig {
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  size_t smem = 0;              // dynamic shared memory, bytes
  cudaStream_t stream = nullptr;
  bool cooperative = false;     // every block resident at once (needed by grid_sync)
};

#if defined(__CUDACC__) || defined(DSPARK_SIMT)  // launching needs nvcc (or the SIMT runtime)
// Launch `kernel(args...)` with `cfg`. Returns the launch status on the GPU; in the SIMT build a fault (divergent
// barrier, bad shuffle mask, ...) throws std::runtime_error naming `name`. Arguments are converted to the
// kernel's parameter types first, as <<<>>> does.
template <typename... Params, typename... Args>
inline cudaError_t launch(const char* name, void (*kernel)(Params...), const LaunchConfig& cfg, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "dspark::launch: wrong number of kernel arguments");
#if defined(DSPARK_SIMT)
  std::tuple<Params...> params(static_cast<Params>(std::forward<Args>(args))...);
  simt::launch(simt::LaunchSpec{name, cfg.grid, cfg.block, cfg.smem, cfg.cooperative},
               [&]() { std::apply(kernel, params); });
  return cudaSuccess;
#else
  (void)name;
  if (cfg.cooperative) {
    std::tuple<Params...> params(static_cast<Params>(std::forward<Args>(args))...);
    void* ptrs[sizeof...(Params) + 1] = {};
    std::apply([&](auto&... p) {
      int i = 0;
      ((ptrs[i++] = static_cast<void*>(&p)), ...);
    }, params);
    return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), cfg.grid, cfg.block, ptrs, cfg.smem,
                                       cfg.stream);
  }
  kernel<<<cfg.grid, cfg.block, cfg.smem, cfg.stream>>>(static_cast<Params>(std::forward<Args>(args))...);
  return cudaGetLastError();
#endif
}

// Grid-wide barrier of a cooperative launch (also orders global memory: writes before it are visible after it).
DSPARK_DEVICE void grid_sync() {
#if defined(DSPARK_SIMT)
  simt::grid_sync(DSPARK_SIMT_SITE);
#else
  cooperative_groups::this_grid().sync();
#endif
}
#endif

// ------------------------------------------------------------------------------------------------ device info
// Multiprocessors of the current device (cached; no sync). The SIMT build reports its setting (132 by default).
#if defined(DSPARK_SIMT)
inline int device_sm_count() { return simt::settings().sm_count; }
#else
inline int device_sm_count() {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cache[dev] <= 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
    cache[dev] = sms;
  }
  return cache[dev];
}
#endif

// How many blocks of `threads` threads and `smem` bytes of dynamic shared memory fit on one SM at once.
template <typename Kernel>
inline int max_active_blocks_per_sm(Kernel kernel, int threads, size_t smem) {
#if defined(DSPARK_SIMT)
  (void)kernel;
  const simt::Settings& s = simt::settings();
  int by_threads = s.max_threads_per_sm / (threads > 0 ? threads : 1);
  int by_smem = smem ? static_cast<int>(s.smem_per_sm / smem) : 32;
  int n = by_threads < by_smem ? by_threads : by_smem;
  return n < 32 ? n : 32;
#else
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) return 1;
  return n;
#endif
}


}  // namespace dspark
