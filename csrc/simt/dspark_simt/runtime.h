// dspark_simt/runtime.h: a small SIMT runtime that runs the CUDA templates of csrc/include/dspark on the CPU.
//
// Compiled instead of nvcc's device side when DSPARK_SIMT is defined (csrc/include/dspark/platform.cuh includes
// this header). Every CUDA thread of a block is a fiber with its own stack; the fibers of one block (of the whole
// grid for a cooperative launch) run on one OS thread, each until it reaches a synchronisation point
// (__syncthreads, a warp collective, the grid barrier) or returns. What it checks and counts:
//   * barriers: a __syncthreads that not every live thread of the block reaches, or two barriers met in the same
//     phase (divergent code), fails the launch with an error naming the kernel and the source lines;
//   * warp collectives (shuffles, votes, __syncwarp, __reduce_*): every lane named in the mask must arrive at the
//     same collective, and the calling lane must be in the mask; a lane that exited or waits elsewhere fails the
//     launch;
//   * schedules: the order in which runnable fibers resume ("forward", "reverse", "random:<seed>"), so a missing
//     barrier shows up as a difference between two runs; shared memory is filled with a poison byte before every
//     block, so reading unwritten shared memory shows up the same way (dspark_kernels.simt.check runs both);
//   * counters per launch: grid, block, shared memory, CTAs, threads, barriers completed, global bytes read and
//     written through dspark::ldg / dspark::stg / atomics (csrc/include/dspark/platform.cuh);
//   * out-of-bounds global accesses are left to AddressSanitizer (the sanitized build), which also sees the
//     shared-memory arena's unused bytes as poisoned.
// Not modelled: timing, memory ordering between threads other than through the synchronisation points above,
// fast-math numerics, warp-synchronous code without __syncwarp, and Hopper-only instructions.
#pragma once

#if !defined(DSPARK_SIMT)
#error "dspark_simt/runtime.h is the host runtime of the SIMT build (DSPARK_SIMT)"
#endif

// Execution-space keywords are plain C++ here; defined before the toolkit headers so they keep these meanings.
#define __host__
#define __device__
#define __global__

#include <cuda_runtime.h>  // types only (dim3, float4, cudaError_t, cudaStream_t); nothing links cudart
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math_constants.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#undef __shared__
#define __shared__ __shared__is_not_available_in_the_SIMT_build__use_DSPARK_SHARED_or_DSPARK_DYNAMIC_SMEM

namespace dspark {
namespace simt {

// One source location (a barrier or collective call site): what error messages name.
struct Site {
  const char* file;
  int line;
};

// The warp access model's counts (see DESIGN, "The warp access model"): warp-level shared and global memory
// instructions, shared-memory wavefronts under the bank rule, 32-byte global sectors touched and the ideal count.
struct AccessCounts {
  uint64_t shared_instructions = 0, shared_wavefronts = 0, shared_wavefronts_ideal = 0;
  uint64_t global_instructions = 0, global_sectors = 0, global_sectors_ideal = 0;
  void add(const AccessCounts& o) {
    shared_instructions += o.shared_instructions;
    shared_wavefronts += o.shared_wavefronts;
    shared_wavefronts_ideal += o.shared_wavefronts_ideal;
    global_instructions += o.global_instructions;
    global_sectors += o.global_sectors;
    global_sectors_ideal += o.global_sectors_ideal;
  }
};

struct LaunchRecord {
  const char* kernel = "";
  std::string symbol;  // the kernel function's linker symbol ("" when it has none of its own)
  int registers = 0;   // per thread, from the settings' table (0: unknown)
  int ctas_per_sm = 0; // the occupancy query's answer for this launch's block and shared memory (at launch time)
  dim3 grid{1, 1, 1}, block{1, 1, 1};
  uint64_t dynamic_smem = 0, static_smem = 0;
  bool cooperative = false;
  bool pdl = false;  // a programmatic dependent launch (dspark::LaunchConfig::pdl)
  uint64_t bytes_read = 0, bytes_written = 0;                // every access, as requested
  uint64_t unique_bytes_read = 0, unique_bytes_written = 0;  // distinct addresses (a perfect cache's traffic)
  bool dram_estimated = false;   // settings().dram was on
  uint64_t dram_bytes_read = 0;  // the L2 estimate's DRAM reads (32-byte sectors; see estimate_dram_reads)
  uint64_t barriers = 0;         // __syncthreads completed, summed over blocks
  uint64_t warp_collectives = 0;  // warp collectives completed, summed over warps
  uint64_t grid_barriers = 0;
  uint64_t mma = 0;  // warp-wide m16n8k16 MMAs (dspark/mma_sync.cuh), summed over warps
  // The access model (kept only while recording, and only in the counting build: see access_model_available()).
  bool access_model = false;
  AccessCounts access;
  uint64_t misaligned_segments = 0;  // warp segments whose lanes' access sequences did not line up
  uint64_t misaligned_accesses = 0;  // lane accesses in those segments
  // Per code address (offset into the module, see module_path()): the same counts, for a per-source-line view.
  std::vector<std::pair<uint32_t, AccessCounts>> by_pc;
};

struct Block;

// Per-fiber view of the launch: what threadIdx & co. read.
struct ThreadCtx {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  unsigned lane, warp;
  Block* block;
  LaunchRecord* record;
};

// Functions of the runtime that kernel code calls are never instrumented by the access model (their own loads and
// stores are the runtime's, not the kernel's); the built-ins return by value so reading them is no memory access.
#define DSPARK_SIMT_UNMODELLED __attribute__((no_sanitize_address))

ThreadCtx& ctx();  // the calling fiber's context (error outside a kernel)
uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
unsigned lane_id();

// The kernel body of a launch runs inside a KernelScope: only there are loads and stores modelled (copying the
// kernel's arguments into the thread is not).
struct KernelScope {
  KernelScope();
  ~KernelScope();
};

// True when this build has the access model (the counting build, DSPARK_SIMT_MODEL; the plain build has no hooks,
// and the AddressSanitizer build none either, since GCC's kernel-address instrumentation that feeds them cannot be
// combined with AddressSanitizer).
bool access_model_available();
// The file of the loaded module, for symbolising the code addresses of LaunchRecord::by_pc (addr2line -e).
const char* module_path();
// An access the compiler does not see as one (an emulated instruction): modelled like an instrumented load or
// store of `bytes` at `p`, attributed to the code address `pc`.
void model_access(const void* p, size_t bytes, bool write, const void* pc);

// cp.async emulation: the copy is queued and happens when a wait completes its group; a load or store of a queued
// destination before that fails the launch. src_bytes < bytes zero-fills the rest (0: nothing is read).
void cp_async(void* smem_dst, const void* gmem_src, int bytes, int src_bytes, const void* pc);
void cp_async_commit();
void cp_async_wait(int pending_groups);  // wait_group N: all but the newest N committed groups complete
void cp_async_wait_all();                // every queued copy completes, committed or not

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), recorded per kernel.
void set_max_dynamic_smem(const void* kernel, size_t bytes);
void forget_max_dynamic_smem(const void* kernel);  // as if never set (for the harness's own tests)

// Synchronisation points (called by the intrinsics below).
void syncthreads(Site site);
int syncthreads_count(Site site, int pred);  // number of threads with pred != 0
void grid_sync(Site site);
// Programmatic dependent launch. The launches run in stream order, each to its end, so the wait is satisfied when it
// is called; what the harness checks is the GPU's rule for a launch with LaunchSpec::pdl, which may start while the
// launch before it still runs: until a thread has called grid_dependency_wait it writes no global memory and reads
// no byte the launch before wrote (either fails the launch), and it calls launch_dependents only after its wait (so
// the launch after it cannot start before the one before it has ended).
void grid_dependency_wait(Site site);
void launch_dependents(Site site);
// Warp collective: deposits `value`, waits for the lanes of `mask`, and fills `values[32]` with what each lane of
// the warp deposited (lanes outside the mask keep the caller's own value). Returns the mask of lanes that arrived.
unsigned warp_collective(Site site, unsigned mask, uint64_t value, uint64_t* values);
unsigned active_mask();
// Fails the launch from device code with `msg` (what the shared headers' operand checks call).
[[noreturn]] void device_fault(const char* msg);

// Shared memory of the running block: a static allocation keyed by its call site, or the dynamic region.
void* shared_alloc(const void* key, size_t bytes, size_t align);
void* dynamic_smem();

// Global-memory accounting (dspark::ldg / stg / atomics).
void count_read(const void* p, size_t bytes);
void count_write(const void* p, size_t bytes);
bool in_shared_memory(const void* p);  // p lies in the running block's shared memory
void count_mma();  // one warp-wide tensor-core MMA (called by every lane; lane 0 counts)

// Launch: runs body() once per thread of every block; throws std::runtime_error naming `kernel` on a fault.
struct LaunchSpec {
  const char* kernel;
  dim3 grid, block;
  size_t dynamic_smem;
  bool cooperative;
  const void* func = nullptr;  // the kernel function: what set_max_dynamic_smem keys on
  bool pdl = false;            // a programmatic dependent launch (grid_dependency_wait's rule applies)
};
void launch(const LaunchSpec& spec, const std::function<void()>& body);

// Settings (module.cpp exposes them to Python).
enum class Order { kForward, kReverse, kRandom };
struct Settings {
  Order order = Order::kForward;
  uint64_t seed = 0;             // for kRandom
  unsigned char poison = 0xFF;   // shared-memory fill before every block
  int sm_count = 132;            // what dspark::device_sm_count() reports (an H100/H200 by default)
  // The launch rules of the device modelled (sm_90 by default; configure(arch=80) for an A100): the per-block
  // opt-in maximum of shared memory (static + dynamic), the SM's shared memory, the 1 KB the driver reserves per
  // block, the default dynamic limit without the attribute, threads and registers per SM and per block.
  int arch = 90;
  size_t max_smem_per_block = 227 * 1024;
  size_t smem_per_sm = 228 * 1024;
  size_t reserved_smem_per_block = 1024;
  size_t default_dynamic_smem_limit = 48 * 1024;
  int max_threads_per_sm = 2048;
  int max_blocks_per_sm = 32;
  int registers_per_sm = 65536;
  int registers_per_block = 65536;
  // Registers per thread of kernels, by linker symbol (the mangled names of the SASS report, tools/check_cuda.py,
  // which the harness's kernel functions share); a kernel not listed is not held to the register rules.
  std::vector<std::pair<std::string, int>> registers;
  bool record = false;           // keep a LaunchRecord per launch
  bool access = false;           // with record: run the warp access model too (counting build; tens of times slower)
  bool dram = false;             // with record: the DRAM-read estimate too (a table of every 32-byte sector touched)
  uint64_t l2_bytes = 50ull << 20;  // the L2 of the DRAM-read estimate (50 MB: H100 SXM5 / H200, one GH100 die)
};
Settings& settings();
// Blocks of `threads` threads and `dynamic_smem` bytes resident per SM under the settings' limits (static shared
// memory as seen in earlier launches of `func`, its registers when the settings' table lists its symbol).
int max_active_blocks(const void* func, int threads, size_t dynamic_smem);
// Records of the launches since the last call (when settings().record), oldest first.
void take_records(void (*sink)(const LaunchRecord&, void*), void* user);
size_t pending_records();

}  // namespace simt
}  // namespace dspark

// ------------------------------------------------------------------------------------------------ built-ins
#define threadIdx (::dspark::simt::thread_idx())
#define blockIdx (::dspark::simt::block_idx())
#define blockDim (::dspark::simt::block_dim())
#define gridDim (::dspark::simt::grid_dim())
#ifndef warpSize
#define warpSize 32
#endif

#define DSPARK_SIMT_SITE (::dspark::simt::Site{__FILE__, __LINE__})
#define __syncthreads() ::dspark::simt::syncthreads(DSPARK_SIMT_SITE)
#define __syncthreads_count(p) ::dspark::simt::syncthreads_count(DSPARK_SIMT_SITE, (p))
#define __syncthreads_or(p) (::dspark::simt::syncthreads_count(DSPARK_SIMT_SITE, (p)) != 0)
#define __syncthreads_and(p) \
  (::dspark::simt::syncthreads_count(DSPARK_SIMT_SITE, (p)) == static_cast<int>(blockDim.x * blockDim.y * blockDim.z))
#define __syncwarp ::dspark::simt::detail::SyncWarp{DSPARK_SIMT_SITE}  // __syncwarp() or __syncwarp(mask)
#define __shfl_sync(mask, v, src, ...) ::dspark::simt::detail::shfl(DSPARK_SIMT_SITE, 0, mask, v, src, ##__VA_ARGS__)
#define __shfl_xor_sync(mask, v, m, ...) ::dspark::simt::detail::shfl(DSPARK_SIMT_SITE, 1, mask, v, m, ##__VA_ARGS__)
#define __shfl_down_sync(mask, v, d, ...) ::dspark::simt::detail::shfl(DSPARK_SIMT_SITE, 2, mask, v, d, ##__VA_ARGS__)
#define __shfl_up_sync(mask, v, d, ...) ::dspark::simt::detail::shfl(DSPARK_SIMT_SITE, 3, mask, v, d, ##__VA_ARGS__)
#define __ballot_sync(mask, p) ::dspark::simt::detail::ballot(DSPARK_SIMT_SITE, mask, (p))
#define __any_sync(mask, p) (::dspark::simt::detail::ballot(DSPARK_SIMT_SITE, mask, (p)) != 0u)
#define __all_sync(mask, p) \
  (::dspark::simt::detail::ballot(DSPARK_SIMT_SITE, mask, (p)) == ::dspark::simt::detail::arrived_mask(mask))
#define __reduce_add_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 0, mask, v)
#define __reduce_min_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 1, mask, v)
#define __reduce_max_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 2, mask, v)
#define __reduce_and_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 3, mask, v)
#define __reduce_or_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 4, mask, v)
#define __reduce_xor_sync(mask, v) ::dspark::simt::detail::reduce(DSPARK_SIMT_SITE, 5, mask, v)
#define __activemask() ::dspark::simt::active_mask()

namespace dspark {
namespace simt {
namespace detail {

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp collectives move up to 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}

struct SyncWarp {
  Site site;
  void operator()(unsigned mask = 0xffffffffu) const {
    uint64_t values[32];
    warp_collective(site, mask, 0, values);
  }
};

// kind: 0 = idx, 1 = xor, 2 = down, 3 = up (CUDA's semantics, including `width` sub-warps).
template <typename T>
inline T shfl(Site site, int kind, unsigned mask, T v, int arg, int width = 32) {
  uint64_t values[32];
  warp_collective(site, mask, to_bits(v), values);
  const int lane = static_cast<int>(lane_id());
  const int base = lane & ~(width - 1);
  int src = lane;
  switch (kind) {
    case 0: src = base + (arg & (width - 1)); break;
    case 1: src = lane ^ arg; if (src >= base + width) src = lane; break;
    case 2: src = lane + arg; if (src >= base + width) src = lane; break;
    default: src = lane - arg; if (src < base) src = lane; break;
  }
  if (src < 0 || src > 31) src = lane;
  return from_bits<T>(values[src]);
}

inline unsigned ballot(Site site, unsigned mask, bool pred) {
  uint64_t values[32];
  const unsigned arrived = warp_collective(site, mask, pred ? 1u : 0u, values);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l)
    if (((arrived >> l) & 1u) && values[l]) out |= 1u << l;
  return out;
}
inline unsigned arrived_mask(unsigned mask) { return mask; }

template <typename T>
inline T reduce(Site site, int kind, unsigned mask, T v) {
  static_assert(std::is_integral<T>::value && sizeof(T) == 4, "__reduce_*_sync takes 32-bit integers");
  uint64_t values[32];
  const unsigned arrived = warp_collective(site, mask, to_bits(v), values);
  bool first = true;
  T acc = 0;
  for (int l = 0; l < 32; ++l) {
    if (!((arrived >> l) & 1u)) continue;
    const T x = from_bits<T>(values[l]);
    if (first) { acc = x; first = false; continue; }
    switch (kind) {
      case 0: acc = static_cast<T>(acc + x); break;
      case 1: acc = x < acc ? x : acc; break;
      case 2: acc = x > acc ? x : acc; break;
      case 3: acc &= x; break;
      case 4: acc |= x; break;
      default: acc ^= x; break;
    }
  }
  return acc;
}

}  // namespace detail
}  // namespace simt
}  // namespace dspark

// ------------------------------------------------------------------------------------------------ intrinsics
// Global loads through __ldg are counted like dspark::ldg.
template <typename T>
inline T __ldg(const T* p) {
  ::dspark::simt::count_read(p, sizeof(T));
  return *p;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
// The fast-math intrinsics are the accurate functions here (the harness does not model their error).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float exp2f_approx(float x) { return exp2f(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) {}
inline long long clock64() { return 0; }

// Atomics: on global memory a read and a write of sizeof(T) each; on shared memory no global traffic (fibers never
// run concurrently, so plain C++ is atomic here).
namespace dspark {
namespace simt {
namespace detail {
template <typename T, typename F>
inline T atomic_rmw(T* p, F&& f) {
  if (!in_shared_memory(p)) {
    count_read(p, sizeof(T));
    count_write(p, sizeof(T));
  }
  const T old = *p;
  *p = f(old);
  return old;
}
}  // namespace detail
}  // namespace simt
}  // namespace dspark

template <typename T>
inline T atomicAdd(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return T(o + v); }); }
template <typename T>
inline T atomicSub(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return T(o - v); }); }
template <typename T>
inline T atomicMax(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return v > o ? v : o; }); }
template <typename T>
inline T atomicMin(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return v < o ? v : o; }); }
template <typename T>
inline T atomicExch(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T) { return v; }); }
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return o == compare ? v : o; });
}
template <typename T>
inline T atomicOr(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return T(o | v); }); }
template <typename T>
inline T atomicAnd(T* p, T v) { return ::dspark::simt::detail::atomic_rmw(p, [&](T o) { return T(o & v); }); }
