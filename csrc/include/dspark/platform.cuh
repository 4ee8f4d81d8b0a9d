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
//   * a persistent kernel synchronises its grid with dspark::grid_sync() inside a cooperative launch;
//   * a kernel launched with LaunchConfig::pdl (programmatic dependent launch) may start while the launch before it
//     in the stream still runs: it calls dspark::grid_dependency_wait() before it reads anything that launch wrote
//     or writes global memory at all, and dspark::launch_dependents() (if at all) only after that wait.
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
#include <cuda_fp8.h>
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

// ------------------------------------------------------------------------------------------------ cp.async
// Asynchronous global -> shared copies (sm_80+): cp_async<Bytes>(dst, src) queues a copy of Bytes (4, 8 or 16)
// from global `src` to shared `dst` (both Bytes-aligned); cp_async_zfill<Bytes>(dst, src, src_bytes) copies only
// the first src_bytes (0..Bytes; 0 reads nothing, so `src` may then be any address) and zero-fills the rest, which
// is also the predicated form (src_bytes = pred ? Bytes : 0). cp_async_commit() closes the thread's group of copies
// issued since the last commit; cp_async_wait<N>() waits until at most the N newest committed groups are still in
// flight; cp_async_wait_all() waits for every copy, committed or not. A wait makes the copies visible to the
// thread that issued them; other threads see them after a __syncthreads that follows the wait.
// GPU: cp.async.cg (16 bytes, bypassing L1) / cp.async.ca (4, 8), cp.async.commit_group, cp.async.wait_group N,
// cp.async.wait_all. SIMT: the copy happens at the wait, and a load or store of a destination before its wait fails
// the launch; the access model counts the global read (sectors) and the shared write (wavefronts) at the issue.
template <int Bytes>
DSPARK_DEVICE void cp_async_zfill(void* smem_dst, const void* gmem_src, int src_bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(DSPARK_SIMT)
  simt::cp_async(smem_dst, gmem_src, Bytes, src_bytes, nullptr);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem_src), "n"(Bytes),
                 "r"(src_bytes)
                 : "memory");
  }
#elif defined(__CUDA_ARCH__)
  // before sm_80: a synchronous copy with the same meaning
  unsigned char* d = static_cast<unsigned char*>(smem_dst);
  const unsigned char* s = static_cast<const unsigned char*>(gmem_src);
  for (int i = 0; i < Bytes; ++i) d[i] = i < src_bytes ? s[i] : 0;
#else
  (void)smem_dst, (void)gmem_src, (void)src_bytes;
#endif
}
// The same, all Bytes read (no source-size operand on the GPU).
template <int Bytes>
DSPARK_DEVICE void cp_async(void* smem_dst, const void* gmem_src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(DSPARK_SIMT)
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem_src), "n"(Bytes) : "memory");
  }
#else
  cp_async_zfill<Bytes>(smem_dst, gmem_src, Bytes);
#endif
}
DSPARK_DEVICE void cp_async_commit() {
#if defined(DSPARK_SIMT)
  simt::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
DSPARK_DEVICE void cp_async_wait() {
  static_assert(N >= 0 && N <= 7, "cp.async.wait_group takes 0..7");
#if defined(DSPARK_SIMT)
  simt::cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
DSPARK_DEVICE void cp_async_wait_all() {
#if defined(DSPARK_SIMT)
  simt::cp_async_wait_all();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------------------------ launch
struct LaunchConfig {
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  size_t smem = 0;              // dynamic shared memory, bytes
  cudaStream_t stream = nullptr;
  bool cooperative = false;     // every block resident at once (needed by grid_sync)
  // Programmatic dependent launch (sm_90+): the launch may start before the one before it in the stream ends (its
  // blocks wait in grid_dependency_wait); on other devices, and in the SIMT build, an ordinary stream-ordered launch.
  bool pdl = false;
};

#if !defined(DSPARK_SIMT)
inline bool device_supports_pdl();  // compute capability 9.0 or later (below)
#endif

#if defined(__CUDACC__) || defined(DSPARK_SIMT)  // launching needs nvcc (or the SIMT runtime)
// Launch `kernel(args...)` with `cfg`. Returns the launch status on the GPU; in the SIMT build a fault (divergent
// barrier, bad shuffle mask, ...) throws std::runtime_error naming `name`. Arguments are converted to the
// kernel's parameter types first, as <<<>>> does.
template <typename... Params, typename... Args>
inline cudaError_t launch(const char* name, void (*kernel)(Params...), const LaunchConfig& cfg, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "dspark::launch: wrong number of kernel arguments");
#if defined(DSPARK_SIMT)
  std::tuple<Params...> params(static_cast<Params>(std::forward<Args>(args))...);
  simt::launch(simt::LaunchSpec{name, cfg.grid, cfg.block, cfg.smem, cfg.cooperative,
                                reinterpret_cast<const void*>(kernel), cfg.pdl},
               [&]() {
                 // the thread's copies of the kernel and its arguments (not modelled accesses)
                 void (*fn)(Params...) = kernel;
                 std::tuple<Params...> mine(params);
                 simt::KernelScope scope;
                 std::apply(fn, mine);
               });
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
  if (cfg.pdl && device_supports_pdl()) {
    cudaLaunchConfig_t lc = {};
    lc.gridDim = cfg.grid;
    lc.blockDim = cfg.block;
    lc.dynamicSmemBytes = cfg.smem;
    lc.stream = cfg.stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = attr;
    lc.numAttrs = 1;
    return cudaLaunchKernelEx(&lc, kernel, static_cast<Params>(std::forward<Args>(args))...);
  }
  kernel<<<cfg.grid, cfg.block, cfg.smem, cfg.stream>>>(static_cast<Params>(std::forward<Args>(args))...);
  return cudaGetLastError();
#endif
}

// Programmatic dependent launch, device side (LaunchConfig::pdl). grid_dependency_wait: until the launch before this
// one in the stream has ended and its writes are visible (a no-op without a dependency: an ordinary launch, a device
// before sm_90, the SIMT build, which checks the rule instead). launch_dependents: this block lets the next launch
// start (it still waits in its own grid_dependency_wait for this one to end).
DSPARK_DEVICE void grid_dependency_wait() {
#if defined(DSPARK_SIMT)
  simt::grid_dependency_wait(DSPARK_SIMT_SITE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
DSPARK_DEVICE void launch_dependents() {
#if defined(DSPARK_SIMT)
  simt::launch_dependents(DSPARK_SIMT_SITE);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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
#if !defined(DSPARK_SIMT)
// Attribute A of the current device (cached per device: no sync after the first call), `fallback` when it cannot
// be read.
template <cudaDeviceAttr A>
inline int device_attribute(int fallback) {
  static int cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return fallback;
  if (cache[dev] <= 0) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, A, dev) != cudaSuccess || value <= 0) value = fallback;
    cache[dev] = value;
  }
  return cache[dev];
}
#endif

#if !defined(DSPARK_SIMT)
// Whether the current device takes programmatic dependent launches (compute capability 9.0 or later).
inline bool device_supports_pdl() { return device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 9; }
#endif

// Multiprocessors of the current device (132 when unknown). The SIMT build reports its setting (132 by default).
// The most shared memory (static + dynamic, bytes) one block of the current device may opt in to: 227 KB on sm_90,
// 163 KB on sm_80 (48 KB when unknown). The SIMT build reports the limit of the arch it models.
#if defined(DSPARK_SIMT)
inline int device_sm_count() { return simt::settings().sm_count; }
inline size_t device_max_smem_per_block() { return simt::settings().max_smem_per_block; }
#else
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(132); }
inline size_t device_max_smem_per_block() {
  return static_cast<size_t>(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024));
}
#endif

// How many blocks of `threads` threads and `smem` bytes of dynamic shared memory fit on one SM at once; 0 when the
// occupancy query fails (an invalid configuration, or a kernel image missing for the device): a caller sizing a
// grid from it must treat 0 as an error, never launch on it. Call set_max_dynamic_smem first for smem > 48 KB.
template <typename Kernel>
inline int max_active_blocks_per_sm(Kernel kernel, int threads, size_t smem) {
#if defined(DSPARK_SIMT)
  return simt::max_active_blocks(reinterpret_cast<const void*>(kernel), threads, smem);
#else
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error state: the caller reports the failure
    return 0;
  }
  return n;
#endif
}

// Lets `kernel` launch with up to `bytes` of dynamic shared memory (a GPU refuses more than 48 KB of static plus
// dynamic shared memory without it): cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) on the GPU,
// recorded and enforced by the SIMT harness. Returns the CUDA status (an error when static + bytes exceed the
// device's per-block maximum, 227 KB on sm_90, 163 KB on sm_80).
template <typename Kernel>
inline cudaError_t set_max_dynamic_smem(Kernel kernel, size_t bytes) {
#if defined(DSPARK_SIMT)
  simt::set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
  return cudaSuccess;
#else
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
#endif
}

// Dynamic shared memory a block may use without set_max_dynamic_smem, given its static shared memory.
constexpr size_t kDefaultSmemPerBlock = 48 * 1024;

// The most CTAs a grid holds in x.
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;


}  // namespace dspark
