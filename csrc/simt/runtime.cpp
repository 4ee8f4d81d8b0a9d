// The SIMT runtime behind dspark_simt/runtime.h: fibers, the scheduler, barriers, warp collectives, shared memory.
//
// A launch runs its blocks one at a time (all at once for a cooperative launch, whose grid barrier needs every
// block resident). Each CUDA thread is a fiber on a pooled stack; the scheduler resumes runnable fibers in the
// configured order and each runs until it blocks at a synchronisation point or returns. A fault found inside a
// fiber is recorded and the launch is abandoned (its fibers are never resumed) and reported as a
// std::runtime_error. Nothing here is thread-safe: one OS thread launches at a time.
#include "dspark_simt/runtime.h"

#include <dlfcn.h>
#include <sys/mman.h>

#include "access_model.h"

#include <algorithm>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// DSPARK_SIMT_MODEL: the counting build, compiled with GCC's kernel-address instrumentation in call mode, so that
// every load and store of the translation unit calls the __asan_*_noabort hooks at the end of this file (GCC then
// defines __SANITIZE_ADDRESS__ too, without any AddressSanitizer runtime).
#if defined(DSPARK_SIMT_MODEL)
#elif defined(__SANITIZE_ADDRESS__)
#define DSPARK_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSPARK_SIMT_ASAN 1
#endif
#endif
#if defined(DSPARK_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace dspark {
namespace simt {

namespace {

// ------------------------------------------------------------------------------------------- context switch
#if defined(__x86_64__)
// dspark_simt_switch(&save_sp, load_sp): push the callee-saved registers and the FP control words on the current
// stack, store the stack pointer, switch to the other stack, pop its registers, return into it.
extern "C" void dspark_simt_switch(void** save_sp, void* load_sp);
extern "C" void dspark_simt_trampoline();
asm(R"(
.text
.globl dspark_simt_switch
.hidden dspark_simt_switch
.type dspark_simt_switch,@function
dspark_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size dspark_simt_switch,.-dspark_simt_switch

.globl dspark_simt_trampoline
.hidden dspark_simt_trampoline
.type dspark_simt_trampoline,@function
dspark_simt_trampoline:
  movq %r12, %rdi
  call dspark_simt_fiber_main
  ud2
.size dspark_simt_trampoline,.-dspark_simt_trampoline
)");
#endif

}  // namespace

// Internal types (named, not anonymous: ThreadCtx points at a Block).
struct Fiber;
struct Launch;

enum class State { kRunnable, kBarrier, kWarp, kGrid, kExited };

struct Fiber {
  ThreadCtx ctx{};
  State state = State::kRunnable;
  Site wait_site{"", 0};
  unsigned wait_mask = 0;
  uint64_t* collective_out = nullptr;  // where a completing warp collective writes the lanes' values
  unsigned collective_arrived = 0;
  int barrier_value = 0;               // __syncthreads_count: this thread's predicate, then the block's count
  char* stack = nullptr;
  size_t stack_size = 0;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  void* asan_fake_stack = nullptr;
  Launch* launch = nullptr;
  // access model
  bool in_kernel = false;      // inside the launch body's KernelScope
  int runtime_depth = 0;       // inside a runtime function called from the kernel
  std::vector<model::Access> accesses;  // since the warp's last zip
  // cp.async: queued copies, in issue order, and the group each belongs to (groups count from 1; 0 = uncommitted)
  struct CpAsync {
    char* dst;
    const char* src;
    int bytes, src_bytes;
    uint64_t group;
  };
  std::vector<CpAsync> cp_queue;
  uint64_t cp_committed = 0;   // groups committed so far
  bool dependency_waited = false;  // grid_dependency_wait called (a pdl launch's rule)
};

struct WarpGroup {
  Site site;
  unsigned mask;
  unsigned arrived;
  uint64_t values[32];
};

struct Block {
  unsigned linear = 0;
  std::vector<Fiber*> threads;
  unsigned live = 0, exited = 0;
  // __syncthreads
  unsigned bar_arrived = 0;
  Site bar_site{"", 0};
  int bar_count = 0;
  std::vector<Fiber*> bar_waiters;
  // warp collectives, per warp
  std::vector<std::vector<WarpGroup>> warps;
  // shared memory
  char* smem = nullptr;
  size_t dyn = 0, static_used = 0;
  std::vector<std::pair<const void*, size_t>> static_allocs;
};

struct Launch {
  LaunchSpec spec{};
  LaunchRecord* record = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<std::unique_ptr<Block>> blocks;  // resident blocks
  std::vector<Fiber*> fibers;                   // all resident fibers, in thread order
  unsigned grid_live = 0, grid_arrived = 0;
  Site grid_site{"", 0};
  std::vector<Fiber*> grid_waiters;
  std::string error;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  void* sched_fake_stack = nullptr;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  bool model = false;           // the access model runs (recording, counting build)
  bool cp_async_used = false;   // some thread queued a cp.async: destinations are checked
  model::Tally tally;
};

namespace {

// Global accesses of the running launch, in the order they ran (kept only while recording): for the unique-byte
// counts and the DRAM-read estimate.
struct GlobalAccess {
  uintptr_t addr;
  uint32_t cta;         // the block's linear index
  uint16_t bytes;
  uint16_t write : 1;
  uint16_t phase : 15;  // grid barriers the launch had passed (saturating)
};
std::vector<GlobalAccess> g_accesses;

// Distinct bytes of the accesses that are writes (`write`) or reads.
// Distinct bytes of the accesses [first, last), which it sorts by address.
uint64_t unique_bytes(std::vector<GlobalAccess>::iterator first, std::vector<GlobalAccess>::iterator last) {
  std::sort(first, last, [](const GlobalAccess& a, const GlobalAccess& b) { return a.addr < b.addr; });
  uint64_t total = 0;
  uintptr_t end = 0;
  for (auto it = first; it != last; ++it) {
    const uintptr_t lo = std::max(it->addr, end), hi = it->addr + it->bytes;
    if (hi > lo) total += hi - lo;
    if (hi > end) end = hi;
  }
  return total;
}

// DRAM reads of a launch under an L2 of `l2` bytes shared by `resident` CTAs running side by side (a model of what
// L2 keeps, not a cache simulation): the accesses replayed in the order they ran, in 32-byte sectors. A read of a
// sector misses (32 bytes from DRAM) when no access of the launch touched it before; or when its last toucher was
// the same CTA and that CTA has since moved more than its share of L2 (l2 / resident bytes: its own stream would
// have evicted the sector); or when its last toucher was another CTA before the last grid barrier and the launch
// has since moved more than l2 bytes. A sector another CTA touched since the last grid barrier hits: CTAs that
// share data between two grid barriers stream it side by side on a GPU (the harness runs them one after the
// other). Writes allocate in L2: they count as touches here, and as DRAM traffic through the unique bytes written.
// The harness runs a block's threads one after another between two barriers, so a re-read within one barrier
// interval looks nearer than it is on a GPU: the estimate is meant for kernels that stream in barrier-separated
// stages (cp.async rings, tiles).
uint64_t estimate_dram_reads(const std::vector<GlobalAccess>& acc, uint64_t l2, uint64_t resident, uint64_t ctas) {
  struct Touch {  // times in 32-byte units (exact to 137 GB of traffic per launch)
    uint32_t cta, global_at, local_at;
    uint16_t phase;
  };
  const uint64_t share = l2 / std::max<uint64_t>(resident, 1);
  std::unordered_map<uintptr_t, Touch> last;
  last.reserve(acc.size() / 2 + 16);
  std::vector<uint64_t> local(ctas + 1, 0);
  uint64_t now = 0, dram = 0;
  for (const GlobalAccess& a : acc) {
    const uint32_t cta = static_cast<uint32_t>(std::min<uint64_t>(a.cta, ctas));
    for (uintptr_t s = a.addr / 32; s <= (a.addr + a.bytes - 1) / 32; ++s) {
      auto it = last.find(s);
      bool miss = true;
      if (it != last.end()) {
        const Touch& t = it->second;
        miss = t.cta == cta ? local[cta] / 32 - t.local_at > share / 32
                            : (t.phase != a.phase && now / 32 - t.global_at > l2 / 32);
      }
      if (miss && !a.write) dram += 32;
      last[s] = Touch{cta, static_cast<uint32_t>(now / 32), static_cast<uint32_t>(local[cta] / 32),
                      static_cast<uint16_t>(a.phase)};
    }
    now += a.bytes;
    local[cta] += a.bytes;
  }
  return dram;
}

void note_global(uintptr_t addr, size_t bytes, bool write, const ThreadCtx& c) {
  const uint16_t phase = static_cast<uint16_t>(std::min<uint64_t>(c.record->grid_barriers, 32767));
  const uint32_t cta = c.block != nullptr ? c.block->linear : 0u;
  for (size_t done = 0; done < bytes; done += 32768) {
    const size_t n = std::min<size_t>(bytes - done, 32768);
    g_accesses.push_back(GlobalAccess{addr + done, cta, static_cast<uint16_t>(n), write, phase});
  }
}

thread_local Fiber* g_current = nullptr;
thread_local Launch* g_launch = nullptr;
Settings g_settings;
std::vector<LaunchRecord> g_records;
uint64_t g_launch_counter = 0;
std::vector<std::pair<const void*, size_t>> g_max_dynamic_smem;  // set_max_dynamic_smem, per kernel function
// The 32-byte sectors of global memory the launch before the running one wrote, and those the running one writes:
// what a programmatic dependent launch may not read before its grid_dependency_wait.
std::unordered_set<uintptr_t> g_written_before, g_written_now;

// Nonzero while the running fiber executes kernel code whose accesses the hooks must see (the access model is on,
// or a cp.async is queued in this launch); what every hook tests first.
int g_hook = 0;

DSPARK_SIMT_UNMODELLED void refresh_hook() {
  const Fiber* f = g_current;
  g_hook = f != nullptr && f->in_kernel && f->runtime_depth == 0 && g_launch != nullptr &&
           (g_launch->model || g_launch->cp_async_used);
}

// Held by every runtime function kernel code calls: the runtime's own loads and stores are not the kernel's.
struct RuntimeScope {
  Fiber* f;
  DSPARK_SIMT_UNMODELLED RuntimeScope() : f(g_current) {
    if (f) ++f->runtime_depth;
    g_hook = 0;
  }
  DSPARK_SIMT_UNMODELLED ~RuntimeScope() {
    if (f) --f->runtime_depth;
    refresh_hook();
  }
};

std::string where(Site s) {
  std::string f = s.file ? s.file : "?";
  const size_t slash = f.find_last_of('/');
  if (slash != std::string::npos) f = f.substr(slash + 1);
  return f + ":" + std::to_string(s.line);
}
bool same_site(Site a, Site b) { return a.line == b.line && a.file == b.file; }

// ------------------------------------------------------------------------------------------- stacks
size_t stack_bytes() {
  static size_t bytes = [] {
    const char* env = getenv("DSPARK_SIMT_STACK_KB");
    size_t kb = env ? static_cast<size_t>(atol(env)) : 0;
#if defined(DSPARK_SIMT_ASAN)
    if (kb == 0) kb = 512;
#else
    if (kb == 0) kb = 128;
#endif
    return kb * 1024;
  }();
  return bytes;
}

// Fiber stacks come from slabs of kSlabStacks stacks, one mapping each (a mapping per stack would run into
// vm.max_map_count with the tens of thousands of resident threads of a cooperative launch). A canary at the bottom
// of each stack stands in for guard pages: a kernel whose thread overran its stack fails its launch.
constexpr size_t kSlabStacks = 64;
constexpr uint64_t kCanary = 0xD5AC0FFEE0DDBA11ull;
constexpr size_t kCanaryWords = 8;
std::vector<char*> g_stack_pool;

char* take_stack() {
  if (g_stack_pool.empty()) {
    const size_t bytes = stack_bytes() * kSlabStacks;
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("dspark SIMT: out of memory for fiber stacks");
    for (size_t i = kSlabStacks; i > 0; --i) g_stack_pool.push_back(static_cast<char*>(m) + (i - 1) * stack_bytes());
  }
  char* s = g_stack_pool.back();
  g_stack_pool.pop_back();
#if defined(DSPARK_SIMT_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(s, stack_bytes());  // frames abandoned on a fault leave their redzones behind
#endif
  uint64_t* canary = reinterpret_cast<uint64_t*>(s);
  for (size_t i = 0; i < kCanaryWords; ++i) canary[i] = kCanary;
  return s;
}

bool stack_intact(const char* s) {
  const uint64_t* canary = reinterpret_cast<const uint64_t*>(s);
  for (size_t i = 0; i < kCanaryWords; ++i)
    if (canary[i] != kCanary) return false;
  return true;
}

// Every block's shared-memory arena has the size of the largest per-block limit of the archs modelled (sm_90's
// 227 KB), whatever the current setting: the pool reuses arenas across configure(arch=...) calls, so an arena sized
// by an sm_80 setting must never serve a later sm_90 launch.
std::vector<char*> g_smem_pool;
constexpr size_t kSmemArenaBytes = 227 * 1024;
size_t smem_arena_bytes() { return kSmemArenaBytes; }

char* take_smem() {
  if (!g_smem_pool.empty()) {
    char* s = g_smem_pool.back();
    g_smem_pool.pop_back();
    return s;
  }
  void* p = nullptr;
  if (posix_memalign(&p, 128, smem_arena_bytes()) != 0) throw std::runtime_error("dspark SIMT: out of memory");
  return static_cast<char*>(p);
}

void give_smem(char* s) {
#if defined(DSPARK_SIMT_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(s, smem_arena_bytes());
#endif
  g_smem_pool.push_back(s);
}

// ------------------------------------------------------------------------------------------- switching
void switch_to_scheduler(Fiber* f, bool dying) {
  Launch* L = f->launch;
#if defined(DSPARK_SIMT_ASAN)
  __sanitizer_start_switch_fiber(dying ? nullptr : &f->asan_fake_stack, L->sched_stack_bottom, L->sched_stack_size);
#else
  (void)dying;
#endif
#if defined(__x86_64__)
  dspark_simt_switch(&f->sp, L->sched_sp);
#else
  swapcontext(&f->uc, &L->sched_uc);
#endif
#if defined(DSPARK_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, nullptr, nullptr);
#endif
  g_current = f;
}

void resume(Launch* L, Fiber* f) {
  g_current = f;
#if defined(DSPARK_SIMT_ASAN)
  __sanitizer_start_switch_fiber(&L->sched_fake_stack, f->stack, f->stack_size);
#endif
#if defined(__x86_64__)
  dspark_simt_switch(&L->sched_sp, f->sp);
#else
  swapcontext(&L->sched_uc, &f->uc);
#endif
#if defined(DSPARK_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(L->sched_fake_stack, nullptr, nullptr);
#endif
  g_current = nullptr;
}

[[noreturn]] void fault(const std::string& msg);

void on_exit(Fiber* f);

}  // namespace

extern "C" void dspark_simt_fiber_main(Fiber* f) {
#if defined(DSPARK_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &f->launch->sched_stack_bottom, &f->launch->sched_stack_size);
#endif
  g_current = f;
  (*f->launch->body)();
  on_exit(f);
  switch_to_scheduler(f, /*dying=*/true);
  __builtin_trap();  // an exited fiber is never resumed
}

namespace {

#if !defined(__x86_64__)
void ucontext_entry(unsigned hi, unsigned lo) {
  dspark_simt_fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

void init_fiber(Fiber* f) {
  f->stack = take_stack();
  f->stack_size = stack_bytes();
#if defined(__x86_64__)
  // Initial frame, popped by dspark_simt_switch: FP control words, r15, r14, r13, r12 (= the fiber), rbx, rbp,
  // then the return address (the trampoline); after the ret the stack pointer is 16-byte aligned.
  uintptr_t top = reinterpret_cast<uintptr_t>(f->stack + f->stack_size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);
  uint32_t mxcsr = 0x1F80;
  uint16_t fpucw = 0x037F;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpucw) << 32);
  sp[1] = 0;                                   // r15
  sp[2] = 0;                                   // r14
  sp[3] = 0;                                   // r13
  sp[4] = reinterpret_cast<uint64_t>(f);       // r12
  sp[5] = 0;                                   // rbx
  sp[6] = 0;                                   // rbp
  sp[7] = reinterpret_cast<uint64_t>(&dspark_simt_trampoline);
  f->sp = sp;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack;
  f->uc.uc_stack.ss_size = f->stack_size;
  f->uc.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(&f->uc, reinterpret_cast<void (*)()>(&ucontext_entry), 2, static_cast<unsigned>(p >> 32),
              static_cast<unsigned>(p));
#endif
}

// ------------------------------------------------------------------------------------------- faults
[[noreturn]] void fault(const std::string& msg) {
  Fiber* f = g_current;
  if (f == nullptr) throw std::runtime_error("dspark SIMT: " + msg);
  Launch* L = f->launch;
  if (L->error.empty()) {
    std::ostringstream os;
    os << "dspark SIMT: kernel " << L->spec.kernel << ", block (" << f->ctx.block_idx.x << "," << f->ctx.block_idx.y
       << "," << f->ctx.block_idx.z << "), thread (" << f->ctx.thread_idx.x << "," << f->ctx.thread_idx.y << ","
       << f->ctx.thread_idx.z << "): " << msg;
    L->error = os.str();
  }
  f->state = State::kExited;
  switch_to_scheduler(f, /*dying=*/false);
  __builtin_trap();  // the scheduler abandons a launch with an error
}

std::string describe_wait(const Fiber* f) {
  switch (f->state) {
    case State::kExited: return "returned";
    case State::kBarrier: return "waits at __syncthreads (" + where(f->wait_site) + ")";
    case State::kGrid: return "waits at the grid barrier (" + where(f->wait_site) + ")";
    case State::kWarp: {
      std::ostringstream os;
      os << "waits at a warp collective (" << where(f->wait_site) << ", mask 0x" << std::hex << f->wait_mask << ")";
      return os.str();
    }
    default: return "is runnable";
  }
}

DSPARK_SIMT_UNMODELLED Block& my_block() { return *g_current->ctx.block; }

// ------------------------------------------------------------------------------------------- access model
// Zips warp w of block b: its lanes' accesses since the last zip become warp instructions (access_model.h).
void zip_warp(Launch* L, Block& b, size_t w) {
  if (!L->model) return;
  std::vector<model::Access>* lanes[32] = {};
  for (size_t l = 0; l < 32 && w * 32 + l < b.threads.size(); ++l) lanes[l] = &b.threads[w * 32 + l]->accesses;
  model::zip_warp(lanes, L->tally);
}

void zip_block(Launch* L, Block& b) {
  for (size_t w = 0; w < b.warps.size(); ++w) zip_warp(L, b, w);
}

// The lanes of warp w that have not returned.
unsigned live_lanes(const Block& b, size_t w) {
  unsigned m = 0;
  for (size_t l = 0; l < 32 && w * 32 + l < b.threads.size(); ++l)
    if (b.threads[w * 32 + l]->state != State::kExited) m |= 1u << l;
  return m;
}

void complete_cp_async(Fiber* f, uint64_t up_to_group, bool uncommitted_too);

DSPARK_SIMT_UNMODELLED uint32_t code_offset(const void* ra) {
  static const uintptr_t base = [] {
    Dl_info info{};
    return dladdr(reinterpret_cast<void*>(&module_path), &info) ? reinterpret_cast<uintptr_t>(info.dli_fbase)
                                                                 : uintptr_t(0);
  }();
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(ra) - base);
}

// A load or store of kernel code (through the hooks) or of an emulated instruction, by the running fiber: locals
// (its own stack) are left out, shared-memory accesses are checked against its queued cp.async destinations, and
// the access model records the rest.
DSPARK_SIMT_UNMODELLED void on_access(const void* p, size_t bytes, bool write, const void* ra) {
  Fiber* f = g_current;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a - reinterpret_cast<uintptr_t>(f->stack) < f->stack_size) return;  // the thread's own stack: locals
  Block& b = *f->ctx.block;
  const bool shared = a - reinterpret_cast<uintptr_t>(b.smem) < smem_arena_bytes();
  RuntimeScope scope;
  if (shared && !f->cp_queue.empty()) {
    for (const Fiber::CpAsync& c : f->cp_queue) {
      if (a < reinterpret_cast<uintptr_t>(c.dst) + c.bytes && reinterpret_cast<uintptr_t>(c.dst) < a + bytes) {
        std::ostringstream os;
        os << (write ? "wrote" : "read") << " " << bytes << " byte(s) of shared memory at offset "
           << (a - reinterpret_cast<uintptr_t>(b.smem)) << ", the destination of a cp.async of " << c.bytes
           << " bytes that no cp_async_wait has completed yet (" << (c.group ? "committed" : "not committed")
           << "): wait for its group first";
        fault(os.str());
      }
    }
  }
  if (f->launch->model)
    model::push(f->accesses, a, bytes, static_cast<uint8_t>((write ? model::kWrite : 0) | (shared ? model::kShared : 0)),
                code_offset(ra));
}

// Performs the queued copies of f up to group `up_to_group` (and the uncommitted ones when asked), in issue order.
DSPARK_SIMT_UNMODELLED void complete_cp_async(Fiber* f, uint64_t up_to_group, bool uncommitted_too) {
  RuntimeScope scope;
  std::vector<Fiber::CpAsync> keep;
  for (const Fiber::CpAsync& c : f->cp_queue) {
    if (c.group == 0 ? !uncommitted_too : c.group > up_to_group) {
      keep.push_back(c);
      continue;
    }
    if (c.src_bytes > 0) memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));  // a zero-fill may name no source
    memset(c.dst + c.src_bytes, 0, static_cast<size_t>(c.bytes - c.src_bytes));
  }
  f->cp_queue.swap(keep);
}

void on_exit(Fiber* f) {
  Block& b = *f->ctx.block;
  Launch* L = f->launch;
  complete_cp_async(f, ~uint64_t(0), true);  // a GPU thread's copies complete even if it never waited
  f->state = State::kExited;
  b.live -= 1;
  b.exited += 1;
  L->grid_live -= 1;
  if (b.live == 0) zip_block(L, b);
  if (b.bar_arrived > 0)
    fault("returned while " + std::to_string(b.bar_arrived) + " thread(s) of its block wait at __syncthreads (" +
          where(b.bar_site) + "): a barrier in divergent code");
  if (L->grid_arrived > 0)
    fault("returned while other threads wait at the grid barrier (" + where(L->grid_site) + ")");
  for (const WarpGroup& g : b.warps[f->ctx.warp]) {
    if ((g.mask >> f->ctx.lane) & 1u) {
      std::ostringstream os;
      os << "returned while the warp collective at " << where(g.site) << " (mask 0x" << std::hex << g.mask
         << ") names its lane " << std::dec << f->ctx.lane;
      fault(os.str());
    }
  }
}

uint64_t next_random(uint64_t& s) {
  s += 0x9E3779B97F4A7C15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string deadlock_report(Launch* L) {
  for (auto& bp : L->blocks) {
    Block& b = *bp;
    for (size_t w = 0; w < b.warps.size(); ++w) {
      for (const WarpGroup& g : b.warps[w]) {
        for (unsigned l = 0; l < 32; ++l) {
          if (!((g.mask >> l) & 1u) || ((g.arrived >> l) & 1u)) continue;
          const size_t t = w * 32 + l;
          std::ostringstream os;
          os << "dspark SIMT: kernel " << L->spec.kernel << ", block " << b.linear << ", warp " << w
             << ": the warp collective at " << where(g.site) << " has mask 0x" << std::hex << g.mask << std::dec
             << ", which names lane " << l << ", but that lane ";
          if (t >= b.threads.size()) os << "does not exist (the block has " << b.threads.size() << " threads)";
          else os << describe_wait(b.threads[t]);
          return os.str();
        }
      }
    }
    if (b.bar_arrived > 0) {
      for (Fiber* f : b.threads) {
        if (f->state != State::kBarrier) {
          return "dspark SIMT: kernel " + std::string(L->spec.kernel) + ", block " + std::to_string(b.linear) +
                 ": __syncthreads at " + where(b.bar_site) + " waits for thread " +
                 std::to_string(f->ctx.thread_idx.x) + ", which " + describe_wait(f) + " (divergent barrier)";
        }
      }
    }
  }
  if (L->grid_arrived > 0) return "dspark SIMT: kernel " + std::string(L->spec.kernel) + ": grid barrier deadlock";
  return "dspark SIMT: kernel " + std::string(L->spec.kernel) + ": deadlock";
}

// Runs the resident blocks of L to completion; returns false with L->error set on a fault.
bool run_resident(Launch* L) {
  std::vector<size_t> order(L->fibers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (g_settings.order == Order::kReverse) std::reverse(order.begin(), order.end());
  uint64_t rs = g_settings.seed * 0x2545F4914F6CDD1Dull + g_launch_counter;
  size_t done = 0;
  while (done < L->fibers.size()) {
    if (g_settings.order == Order::kRandom) {
      for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random(rs) % i]);
    }
    bool progressed = false;
    for (size_t i : order) {
      Fiber* f = L->fibers[i];
      if (f->state != State::kRunnable) continue;
      progressed = true;
      resume(L, f);
      if (!L->error.empty()) return false;
    }
    done = 0;
    for (Fiber* f : L->fibers) done += f->state == State::kExited;
    if (!progressed && done < L->fibers.size()) {
      L->error = deadlock_report(L);
      return false;
    }
  }
  return true;
}

void release(std::vector<Fiber*>& waiters) {
  for (Fiber* f : waiters) f->state = State::kRunnable;
  waiters.clear();
}

}  // namespace

// ------------------------------------------------------------------------------------------- launch rules
namespace {

std::vector<std::pair<const void*, size_t>> g_static_smem;  // static shared memory seen per kernel function

size_t static_smem_of(const void* func) {
  for (const auto& e : g_static_smem)
    if (e.first == func) return e.second;
  return 0;
}

void note_static_smem(const void* func, size_t bytes) {
  for (auto& e : g_static_smem)
    if (e.first == func) {
      e.second = std::max(e.second, bytes);
      return;
    }
  g_static_smem.emplace_back(func, bytes);
}

const size_t* max_dynamic_smem_of(const void* func) {
  for (const auto& e : g_max_dynamic_smem)
    if (e.first == func && func != nullptr) return &e.second;
  return nullptr;
}

// The linker symbol of a kernel function (its mangled name: the one nvcc gives the GPU build's kernel, so the SASS
// report's table applies as is), cached; "" when the function has no exported symbol of its own.
const std::string& symbol_of(const void* func) {
  static std::unordered_map<const void*, std::string> cache;  // node-based: references stay valid
  auto it = cache.find(func);
  if (it != cache.end()) return it->second;
  Dl_info info{};
  std::string name;
  if (func != nullptr && dladdr(func, &info) != 0 && info.dli_saddr == func && info.dli_sname != nullptr)
    name = info.dli_sname;
  return cache.emplace(func, std::move(name)).first->second;
}

// Registers per thread of a kernel function from the settings' table (0: unknown, no register limit).
int registers_of(const void* func) {
  const std::string& symbol = symbol_of(func);
  if (symbol.empty()) return 0;
  for (const auto& e : g_settings.registers)
    if (e.first == symbol) return e.second;
  return 0;
}

// Registers a block allocates: per thread rounded up to 8, per warp to 256 (sm_80 / sm_90 allocation units).
int registers_per_block(int regs, int threads) {
  const int per_warp = ((regs + 7) / 8 * 8 * 32 + 255) / 256 * 256;
  return per_warp * ((threads + 31) / 32);
}

// The GPU's shared-memory rules for a launch with `static_bytes` of static shared memory: empty when it is legal.
std::string smem_rule(const LaunchSpec& spec, size_t static_bytes) {
  const size_t dyn = spec.dynamic_smem, total = static_bytes + dyn;
  const size_t* attr = max_dynamic_smem_of(spec.func);
  const std::string sizes = std::to_string(static_bytes) + " bytes of static + " + std::to_string(dyn) +
                            " bytes of dynamic shared memory";
  if (total > g_settings.max_smem_per_block)
    return sizes + ": more than the " + std::to_string(g_settings.max_smem_per_block) + " bytes a block may have on sm_" +
           std::to_string(g_settings.arch);
  if (attr == nullptr) {
    if (total > g_settings.default_dynamic_smem_limit)
      return sizes + ": more than the " + std::to_string(g_settings.default_dynamic_smem_limit) +
             " bytes a block gets without cudaFuncAttributeMaxDynamicSharedMemorySize; call "
             "dspark::set_max_dynamic_smem(kernel, " + std::to_string(dyn) + ") before launching";
    return "";
  }
  if (dyn > *attr)
    return sizes + ": more dynamic shared memory than the " + std::to_string(*attr) +
           " bytes of the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize";
  if (static_bytes + *attr > g_settings.max_smem_per_block)
    return sizes + ": the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize of " + std::to_string(*attr) +
           " bytes plus its static shared memory exceed the " + std::to_string(g_settings.max_smem_per_block) +
           " bytes of a block (the GPU refuses the attribute)";
  return "";
}

}  // namespace

// A fault raised by a device-side helper of the shared headers (e.g. a misaligned MMA operand).
void device_fault(const char* msg) {
  RuntimeScope scope;
  fault(msg);
}

// ------------------------------------------------------------------------------------------- public API
DSPARK_SIMT_UNMODELLED uint3 thread_idx() { return ctx().thread_idx; }
DSPARK_SIMT_UNMODELLED uint3 block_idx() { return ctx().block_idx; }
DSPARK_SIMT_UNMODELLED dim3 block_dim() { return ctx().block_dim; }
DSPARK_SIMT_UNMODELLED dim3 grid_dim() { return ctx().grid_dim; }
DSPARK_SIMT_UNMODELLED unsigned lane_id() { return ctx().lane; }

DSPARK_SIMT_UNMODELLED KernelScope::KernelScope() {
  g_current->in_kernel = true;
  refresh_hook();
}
DSPARK_SIMT_UNMODELLED KernelScope::~KernelScope() {
  g_current->in_kernel = false;
  refresh_hook();
}

bool access_model_available() {
#if defined(DSPARK_SIMT_MODEL)
  return true;
#else
  return false;
#endif
}

const char* module_path() {
  static std::string path = [] {
    Dl_info info{};
    return dladdr(reinterpret_cast<void*>(&module_path), &info) && info.dli_fname ? std::string(info.dli_fname)
                                                                                   : std::string();
  }();
  return path.c_str();
}

DSPARK_SIMT_UNMODELLED ThreadCtx& ctx() {
  if (g_current == nullptr) throw std::runtime_error("dspark SIMT: a device built-in was used outside a kernel");
  return g_current->ctx;
}

DSPARK_SIMT_UNMODELLED Settings& settings() { return g_settings; }

void syncthreads(Site site) { (void)syncthreads_count(site, 0); }

int syncthreads_count(Site site, int pred) {
  RuntimeScope scope;
  Fiber* f = g_current;
  Block& b = my_block();
  if (b.exited > 0)
    fault("reached __syncthreads (" + where(site) + ") after " + std::to_string(b.exited) +
          " thread(s) of its block returned: a barrier in divergent code");
  if (b.bar_arrived == 0) {
    b.bar_site = site;
    b.bar_count = 0;
  } else if (!same_site(b.bar_site, site)) {
    fault("reached __syncthreads at " + where(site) + " while other threads of its block wait at " +
          where(b.bar_site) + ": a barrier in divergent code");
  }
  b.bar_count += pred != 0;
  b.bar_arrived += 1;
  if (b.bar_arrived == b.live) {  // the last thread of the block: release everyone
    const int count = b.bar_count;
    for (Fiber* w : b.bar_waiters) w->barrier_value = count;
    release(b.bar_waiters);
    b.bar_arrived = 0;
    f->launch->record->barriers += 1;
    zip_block(f->launch, b);
    return count;
  }
  f->state = State::kBarrier;
  f->wait_site = site;
  b.bar_waiters.push_back(f);
  switch_to_scheduler(f, false);
  return f->barrier_value;
}

void grid_dependency_wait(Site) {
  RuntimeScope scope;
  g_current->dependency_waited = true;
}

void launch_dependents(Site site) {
  RuntimeScope scope;
  const Fiber* f = g_current;
  if (f->launch->spec.pdl && !f->dependency_waited)
    fault("launch_dependents (" + where(site) + ") before grid_dependency_wait in a programmatic dependent launch");
}

void grid_sync(Site site) {
  RuntimeScope scope;
  Fiber* f = g_current;
  Launch* L = f->launch;
  if (!L->spec.cooperative) fault("grid barrier (" + where(site) + ") in a launch that is not cooperative");
  if (L->grid_arrived == 0) L->grid_site = site;
  L->grid_arrived += 1;
  if (L->grid_arrived == L->grid_live) {
    release(L->grid_waiters);
    L->grid_arrived = 0;
    L->record->grid_barriers += 1;
    for (auto& bp : L->blocks) zip_block(L, *bp);
    return;
  }
  f->state = State::kGrid;
  f->wait_site = site;
  L->grid_waiters.push_back(f);
  switch_to_scheduler(f, false);
}

unsigned warp_collective(Site site, unsigned mask, uint64_t value, uint64_t* values) {
  RuntimeScope scope;
  Fiber* f = g_current;
  Block& b = my_block();
  const unsigned lane = f->ctx.lane;
  if (!((mask >> lane) & 1u)) {
    std::ostringstream os;
    os << "warp collective at " << where(site) << " with mask 0x" << std::hex << mask
       << " that does not name the calling lane " << std::dec << lane;
    fault(os.str());
  }
  std::vector<WarpGroup>& groups = b.warps[f->ctx.warp];
  WarpGroup* g = nullptr;
  for (WarpGroup& x : groups) {
    if (x.mask == mask && same_site(x.site, site) && !((x.arrived >> lane) & 1u)) {
      g = &x;
      break;
    }
  }
  if (g == nullptr) {
    groups.push_back(WarpGroup{site, mask, 0u, {}});
    g = &groups.back();
  }
  g->values[lane] = value;
  g->arrived |= 1u << lane;
  f->collective_out = values;
  if (g->arrived == mask) {  // complete: hand every lane the values, wake the others
    const WarpGroup done = *g;
    groups.erase(groups.begin() + (g - groups.data()));
    for (unsigned l = 0; l < 32; ++l) {
      if (!((done.mask >> l) & 1u)) continue;
      Fiber* w = b.threads[f->ctx.warp * 32 + l];
      memcpy(w->collective_out, done.values, sizeof(done.values));
      w->collective_arrived = done.mask;
      if (w != f) w->state = State::kRunnable;
    }
    f->launch->record->warp_collectives += 1;
    if ((done.mask & live_lanes(b, f->ctx.warp)) == live_lanes(b, f->ctx.warp)) zip_warp(f->launch, b, f->ctx.warp);
  } else {
    f->state = State::kWarp;
    f->wait_site = site;
    f->wait_mask = mask;
    switch_to_scheduler(f, false);
  }
  for (unsigned l = 0; l < 32; ++l)
    if (!((mask >> l) & 1u)) values[l] = value;
  return f->collective_arrived;
}

unsigned active_mask() {
  RuntimeScope scope;
  Fiber* f = g_current;
  Block& b = my_block();
  unsigned m = 0;
  for (unsigned l = 0; l < 32; ++l) {
    const size_t t = f->ctx.warp * 32 + l;
    if (t < b.threads.size() && b.threads[t]->state != State::kExited) m |= 1u << l;
  }
  return m;
}

void* shared_alloc(const void* key, size_t bytes, size_t align) {
  RuntimeScope scope;
  Block& b = my_block();
  for (auto& a : b.static_allocs)
    if (a.first == key) return b.smem + a.second;
  if (align < 16) align = 16;
  const size_t off = (b.dyn + b.static_used + align - 1) / align * align;
  const std::string error = smem_rule(g_current->launch->spec, off + bytes - b.dyn);
  if (!error.empty()) fault(error);
#if defined(DSPARK_SIMT_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(b.smem + off, bytes);
#endif
  b.static_allocs.emplace_back(key, off);
  b.static_used = off + bytes - b.dyn;
  note_static_smem(g_current->launch->spec.func, b.static_used);
  LaunchRecord* r = g_current->launch->record;
  if (b.static_used > r->static_smem) r->static_smem = b.static_used;
  return b.smem + off;
}

DSPARK_SIMT_UNMODELLED void* dynamic_smem() { return my_block().smem; }

// A pdl launch's read of [a, a + bytes) before its thread's grid_dependency_wait: an error if the launch before
// wrote any of it.
static void check_dependent_read(uintptr_t a, size_t bytes) {
  const Fiber* f = g_current;
  if (f == nullptr || !f->launch->spec.pdl || f->dependency_waited || g_written_before.empty()) return;
  for (uintptr_t s = a / 32; s <= (a + bytes - 1) / 32; ++s)
    if (g_written_before.count(s) != 0)
      fault("a programmatic dependent launch read memory the launch before it wrote, before grid_dependency_wait");
}

void count_read(const void* p, size_t bytes) {
  RuntimeScope scope;
  check_dependent_read(reinterpret_cast<uintptr_t>(p), bytes);
  ctx().record->bytes_read += bytes;
  if (g_settings.record) note_global(reinterpret_cast<uintptr_t>(p), bytes, false, ctx());
}

bool in_shared_memory(const void* p) {
  RuntimeScope scope;  // (called from kernel code by the atomics: its own reads are not the kernel's)
  const Fiber* f = g_current;
  return f != nullptr && reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(f->ctx.block->smem) <
                             smem_arena_bytes();
}

void count_mma() {
  RuntimeScope scope;
  if (ctx().lane == 0) ctx().record->mma += 1;
}

void count_write(const void* p, size_t bytes) {
  RuntimeScope scope;
  const Fiber* f = g_current;
  if (f != nullptr && f->launch->spec.pdl && !f->dependency_waited)
    fault("a programmatic dependent launch wrote global memory before grid_dependency_wait");
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t s = a / 32; bytes > 0 && s <= (a + bytes - 1) / 32; ++s) g_written_now.insert(s);
  ctx().record->bytes_written += bytes;
  if (g_settings.record) note_global(reinterpret_cast<uintptr_t>(p), bytes, true, ctx());
}


int max_active_blocks(const void* func, int threads, size_t dynamic_smem) {
  const Settings& s = g_settings;
  if (threads <= 0) return 0;
  int n = std::min(s.max_blocks_per_sm, s.max_threads_per_sm / threads);
  const size_t smem = static_smem_of(func) + dynamic_smem + s.reserved_smem_per_block;
  n = std::min<int>(n, static_cast<int>(s.smem_per_sm / smem));
  const int regs = registers_of(func);
  if (regs > 0) n = std::min(n, s.registers_per_sm / registers_per_block(regs, threads));
  return n;
}

void set_max_dynamic_smem(const void* kernel, size_t bytes) {
  for (auto& e : g_max_dynamic_smem)
    if (e.first == kernel) {
      e.second = bytes;
      return;
    }
  g_max_dynamic_smem.emplace_back(kernel, bytes);
}

void forget_max_dynamic_smem(const void* kernel) {
  g_max_dynamic_smem.erase(std::remove_if(g_max_dynamic_smem.begin(), g_max_dynamic_smem.end(),
                                          [&](const auto& e) { return e.first == kernel; }),
                           g_max_dynamic_smem.end());
}

void launch(const LaunchSpec& spec, const std::function<void()>& body) {
  if (g_launch != nullptr) throw std::runtime_error("dspark SIMT: a kernel launched another kernel");
  const uint64_t threads = uint64_t(spec.block.x) * spec.block.y * spec.block.z;
  const uint64_t blocks = uint64_t(spec.grid.x) * spec.grid.y * spec.grid.z;
  auto bad = [&](const std::string& why) {
    return std::runtime_error("dspark SIMT: kernel " + std::string(spec.kernel) + ": invalid launch: " + why);
  };
  if (threads == 0 || threads > 1024) throw bad("block of " + std::to_string(threads) + " threads");
  if (blocks == 0 || spec.grid.x > 2147483647u || spec.grid.y > 65535u || spec.grid.z > 65535u)
    throw bad("grid of " + std::to_string(blocks) + " blocks");
  const std::string smem_error = smem_rule(spec, static_smem_of(spec.func));
  if (!smem_error.empty()) throw bad(smem_error);
  const int regs = registers_of(spec.func);
  if (regs > 0 && registers_per_block(regs, static_cast<int>(threads)) > g_settings.registers_per_block)
    throw bad(std::to_string(threads) + " threads of " + std::to_string(regs) + " registers need " +
              std::to_string(registers_per_block(regs, static_cast<int>(threads))) + " registers, more than the " +
              std::to_string(g_settings.registers_per_block) + " of a block");
  if (spec.cooperative) {
    const int per_sm = max_active_blocks(spec.func, static_cast<int>(threads), spec.dynamic_smem);
    if (blocks > uint64_t(per_sm) * uint64_t(g_settings.sm_count))
      throw bad("a cooperative grid of " + std::to_string(blocks) + " blocks cannot be resident on " +
                std::to_string(g_settings.sm_count) + " SMs (" + std::to_string(per_sm) +
                " per SM at this block size, shared memory and registers)");
  }
  LaunchRecord record;
  record.kernel = spec.kernel;
  record.symbol = symbol_of(spec.func);
  record.registers = regs;
  record.grid = spec.grid;
  record.block = spec.block;
  record.dynamic_smem = spec.dynamic_smem;
  record.cooperative = spec.cooperative;
  record.pdl = spec.pdl;
  g_written_before.swap(g_written_now);
  g_written_now.clear();

  Launch L;
  L.spec = spec;
  L.record = &record;
  L.body = &body;
  L.model = g_settings.record && g_settings.access && access_model_available();
  record.access_model = L.model;
  g_launch = &L;
  ++g_launch_counter;
  std::vector<Fiber> fibers;
  std::string error;
  try {
    // Block order follows the schedule, so inter-block races through global memory show up too.
    std::vector<uint64_t> block_order(blocks);
    for (uint64_t i = 0; i < blocks; ++i) block_order[i] = i;
    if (g_settings.order == Order::kReverse) std::reverse(block_order.begin(), block_order.end());
    if (g_settings.order == Order::kRandom) {
      uint64_t rs = g_settings.seed ^ (g_launch_counter << 17);
      for (size_t i = block_order.size(); i > 1; --i) std::swap(block_order[i - 1], block_order[next_random(rs) % i]);
    }
    const uint64_t resident = spec.cooperative ? blocks : 1;
    fibers.resize(resident * threads);
    for (uint64_t first = 0; first < blocks && error.empty(); first += resident) {
      L.blocks.clear();
      L.fibers.clear();
      L.grid_live = 0;
      L.grid_arrived = 0;
      L.grid_waiters.clear();
      for (uint64_t j = 0; j < resident; ++j) {
        const uint64_t lin = block_order[first + j];
        auto bp = std::make_unique<Block>();
        Block& b = *bp;
        b.linear = static_cast<unsigned>(lin);
        b.smem = take_smem();
        b.dyn = spec.dynamic_smem;
#if defined(DSPARK_SIMT_ASAN)
        ASAN_UNPOISON_MEMORY_REGION(b.smem, smem_arena_bytes());
#endif
        memset(b.smem, g_settings.poison, smem_arena_bytes());
#if defined(DSPARK_SIMT_ASAN)
        ASAN_POISON_MEMORY_REGION(b.smem, smem_arena_bytes());
        ASAN_UNPOISON_MEMORY_REGION(b.smem, b.dyn);
#endif
        b.warps.resize((threads + 31) / 32);
        const uint3 bidx{static_cast<unsigned>(lin % spec.grid.x),
                         static_cast<unsigned>((lin / spec.grid.x) % spec.grid.y),
                         static_cast<unsigned>(lin / (uint64_t(spec.grid.x) * spec.grid.y))};
        for (uint64_t t = 0; t < threads; ++t) {
          Fiber* f = &fibers[j * threads + t];
          *f = Fiber();
          f->launch = &L;
          f->ctx.thread_idx = uint3{static_cast<unsigned>(t % spec.block.x),
                                    static_cast<unsigned>((t / spec.block.x) % spec.block.y),
                                    static_cast<unsigned>(t / (uint64_t(spec.block.x) * spec.block.y))};
          f->ctx.block_idx = bidx;
          f->ctx.block_dim = spec.block;
          f->ctx.grid_dim = spec.grid;
          f->ctx.lane = static_cast<unsigned>(t % 32);
          f->ctx.warp = static_cast<unsigned>(t / 32);
          f->ctx.block = &b;
          f->ctx.record = &record;
          init_fiber(f);
          b.threads.push_back(f);
          L.fibers.push_back(f);
        }
        b.live = static_cast<unsigned>(threads);
        L.grid_live += static_cast<unsigned>(threads);
        L.blocks.push_back(std::move(bp));
      }
      if (!run_resident(&L)) error = L.error;
      for (Fiber* f : L.fibers) {
        if (error.empty() && !stack_intact(f->stack))
          error = "dspark SIMT: kernel " + std::string(spec.kernel) + ": a thread overran its " +
                  std::to_string(stack_bytes() / 1024) + " KiB stack (set DSPARK_SIMT_STACK_KB)";
        g_stack_pool.push_back(f->stack);
      }
      for (auto& bp : L.blocks) give_smem(bp->smem);
    }
  } catch (...) {
    g_launch = nullptr;
    g_accesses.clear();
    throw;
  }
  g_launch = nullptr;
  g_current = nullptr;
  if (g_settings.record) {
    const int per_sm = max_active_blocks(spec.func, static_cast<int>(threads), spec.dynamic_smem);
    const uint64_t resident = std::min<uint64_t>(blocks, uint64_t(std::max(per_sm, 1)) * uint64_t(g_settings.sm_count));
    if (g_settings.dram) {
      record.dram_estimated = true;
      record.dram_bytes_read = estimate_dram_reads(g_accesses, g_settings.l2_bytes, resident, blocks);
    }
    const auto writes = std::partition(g_accesses.begin(), g_accesses.end(),
                                       [](const GlobalAccess& a) { return !a.write; });
    record.unique_bytes_read = unique_bytes(g_accesses.begin(), writes);
    record.unique_bytes_written = unique_bytes(writes, g_accesses.end());
    g_accesses.clear();
    g_accesses.shrink_to_fit();
  }
  record.access = L.tally.total;
  record.misaligned_segments = L.tally.misaligned_segments;
  record.misaligned_accesses = L.tally.misaligned_accesses;
  record.by_pc.assign(L.tally.by_pc.begin(), L.tally.by_pc.end());
  std::sort(record.by_pc.begin(), record.by_pc.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  if (!error.empty()) throw std::runtime_error(error);
  // after the blocks ran: the static shared memory they declared counts
  record.ctas_per_sm = max_active_blocks(spec.func, static_cast<int>(threads), spec.dynamic_smem);
  if (g_settings.record) g_records.push_back(record);
}

// ------------------------------------------------------------------------------------------- emulated instructions
DSPARK_SIMT_UNMODELLED void model_access(const void* p, size_t bytes, bool write, const void* pc) {
  Fiber* f = g_current;
  if (f == nullptr || !f->in_kernel) return;
  on_access(p, bytes, write, pc ? pc : __builtin_return_address(0));
}

DSPARK_SIMT_UNMODELLED void cp_async(void* smem_dst, const void* gmem_src, int bytes, int src_bytes, const void* pc) {
  const void* ra = pc ? pc : __builtin_return_address(0);
  RuntimeScope scope;
  Fiber* f = g_current;
  Block& b = my_block();
  const uintptr_t d = reinterpret_cast<uintptr_t>(smem_dst), s = reinterpret_cast<uintptr_t>(gmem_src);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(b.smem);
  if (bytes != 4 && bytes != 8 && bytes != 16) fault("cp.async copies 4, 8 or 16 bytes, not " + std::to_string(bytes));
  if (src_bytes < 0 || src_bytes > bytes)
    fault("cp.async: src_bytes " + std::to_string(src_bytes) + " is outside [0, " + std::to_string(bytes) + "]");
  if (d < lo || d + bytes > lo + b.dyn + b.static_used)
    fault("cp.async: the destination is not in the block's shared memory");
  if (d % bytes != 0 || (src_bytes > 0 && s % bytes != 0))
    fault("cp.async of " + std::to_string(bytes) + " bytes: source and destination must be " + std::to_string(bytes) +
          "-byte aligned");
  f->launch->cp_async_used = true;
  if (src_bytes > 0) check_dependent_read(s, static_cast<size_t>(src_bytes));
  f->launch->record->bytes_read += static_cast<uint64_t>(src_bytes);
  if (g_settings.record && src_bytes > 0) note_global(s, static_cast<size_t>(src_bytes), false, f->ctx);
  if (f->launch->model) {
    if (src_bytes > 0) model::push(f->accesses, s, static_cast<size_t>(src_bytes), 0, code_offset(ra));
    model::push(f->accesses, d, static_cast<size_t>(bytes), model::kWrite | model::kShared, code_offset(ra));
  }
  f->cp_queue.push_back(Fiber::CpAsync{static_cast<char*>(smem_dst), static_cast<const char*>(gmem_src), bytes,
                                       src_bytes, 0});
  // Until its wait the destination holds no defined value: the run's poison byte, so that a read before the wait
  // (which only the counting build's hooks report as an error) changes the result between simt::check's runs.
  memset(smem_dst, g_settings.poison, static_cast<size_t>(bytes));
}

DSPARK_SIMT_UNMODELLED void cp_async_commit() {
  RuntimeScope scope;
  Fiber* f = g_current;
  f->cp_committed += 1;
  for (Fiber::CpAsync& c : f->cp_queue)
    if (c.group == 0) c.group = f->cp_committed;
}

DSPARK_SIMT_UNMODELLED void cp_async_wait(int pending_groups) {
  RuntimeScope scope;
  Fiber* f = g_current;
  const uint64_t n = static_cast<uint64_t>(pending_groups < 0 ? 0 : pending_groups);
  if (f->cp_committed > n) complete_cp_async(f, f->cp_committed - n, false);
}

DSPARK_SIMT_UNMODELLED void cp_async_wait_all() {
  RuntimeScope scope;
  complete_cp_async(g_current, ~uint64_t(0), true);
}

void take_records(void (*sink)(const LaunchRecord&, void*), void* user) {
  std::vector<LaunchRecord> recs;
  recs.swap(g_records);
  for (const LaunchRecord& r : recs) sink(r, user);
}

size_t pending_records() { return g_records.size(); }

}  // namespace simt
}  // namespace dspark

// ------------------------------------------------------------------------------------------- access hooks
// What GCC's -fsanitize=kernel-address (call mode, --param asan-instrumentation-with-call-threshold=0) calls before
// every load and store of the counting build. Outside modelled kernel code they return at the first test.
#if defined(DSPARK_SIMT_MODEL)
#define DSPARK_SIMT_HOOK(kind, n, write)                                                        \
  extern "C" DSPARK_SIMT_UNMODELLED void __asan_##kind##n##_noabort(void* p) {                  \
    if (__builtin_expect(::dspark::simt::g_hook != 0, 0))                                         \
      ::dspark::simt::on_access(p, n, write, __builtin_return_address(0));                        \
  }
DSPARK_SIMT_HOOK(load, 1, false)
DSPARK_SIMT_HOOK(load, 2, false)
DSPARK_SIMT_HOOK(load, 4, false)
DSPARK_SIMT_HOOK(load, 8, false)
DSPARK_SIMT_HOOK(load, 16, false)
DSPARK_SIMT_HOOK(store, 1, true)
DSPARK_SIMT_HOOK(store, 2, true)
DSPARK_SIMT_HOOK(store, 4, true)
DSPARK_SIMT_HOOK(store, 8, true)
DSPARK_SIMT_HOOK(store, 16, true)
#undef DSPARK_SIMT_HOOK
extern "C" DSPARK_SIMT_UNMODELLED void __asan_loadN_noabort(void* p, long n) {
  if (__builtin_expect(::dspark::simt::g_hook != 0, 0) && n > 0)
    ::dspark::simt::on_access(p, static_cast<size_t>(n), false, __builtin_return_address(0));
}
extern "C" DSPARK_SIMT_UNMODELLED void __asan_storeN_noabort(void* p, long n) {
  if (__builtin_expect(::dspark::simt::g_hook != 0, 0) && n > 0)
    ::dspark::simt::on_access(p, static_cast<size_t>(n), true, __builtin_return_address(0));
}
extern "C" DSPARK_SIMT_UNMODELLED void __asan_handle_no_return() {}
extern "C" DSPARK_SIMT_UNMODELLED void __asan_before_dynamic_init(const void*) {}
extern "C" DSPARK_SIMT_UNMODELLED void __asan_after_dynamic_init() {}
#endif
