// The warp access model of the SIMT runtime: per-thread sequences of shared and global memory accesses between
// synchronisation points, zipped into warp-level instructions and costed the way the hardware costs them.
//
// Zipping: the k-th execution of one load or store (one code address, one space, read or write) by each lane of a
// warp is one warp instruction, which is how a SIMT core runs a divergent warp (each side of a branch is issued
// with the lanes that took it). When the lanes' sequences are not the same sequence of code addresses (lanes that
// made no access aside; repeats of one address in a row count once), the segment is counted as misaligned, so a
// reader knows the pairing rule, not lockstep, made those instructions.
// Costs per warp instruction:
//   * shared memory: wavefronts under the bank rule: 32 banks of 4-byte words; 4-byte (and narrower) accesses are
//     served for the whole warp at once, 8-byte ones per half-warp and 16-byte ones per quarter-warp (the phases);
//     within a phase the cost is the largest number of distinct words any one bank holds (lanes reading one word
//     share it: a broadcast is no conflict); phases without an active lane cost nothing; the ideal count is what
//     the same words cost with no conflict, the distinct words of each phase / 32, rounded up;
//   * global memory: the distinct 32-byte sectors the lanes' bytes touch, and the ideal count, the distinct bytes
//     requested divided by 32, rounded up.
// Accesses wider than 16 bytes (a struct copied at once) are split into the widest aligned pieces of at most 16
// bytes, the vector accesses a GPU compiler would use.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

#include "dspark_simt/runtime.h"

namespace dspark {
namespace simt {
namespace model {

enum : uint8_t { kWrite = 1, kShared = 2 };

struct Access {
  uintptr_t addr;
  uint32_t pc;    // code address, as an offset into the module
  uint8_t size;   // 1, 2, 4, 8 or 16
  uint8_t flags;  // kWrite | kShared
};

struct Tally {
  AccessCounts total;
  std::unordered_map<uint32_t, AccessCounts> by_pc;
  uint64_t misaligned_segments = 0, misaligned_accesses = 0;
};

// Appends an access of `bytes` at `addr`, split into aligned pieces of at most 16 bytes.
inline void push(std::vector<Access>& seq, uintptr_t addr, size_t bytes, uint8_t flags, uint32_t pc) {
  while (bytes > 0) {
    size_t w = 16;
    while (w > bytes || (addr & (w - 1)) != 0) w >>= 1;
    seq.push_back(Access{addr, pc, static_cast<uint8_t>(w), flags});
    addr += w;
    bytes -= w;
  }
}

// Wavefronts of one shared-memory warp instruction, and the ideal count: `lanes[l]` is lane l's access or null.
inline void shared_wavefronts(const Access* const lanes[32], uint64_t& total, uint64_t& ideal) {
  unsigned width = 1;
  for (int l = 0; l < 32; ++l)
    if (lanes[l] && lanes[l]->size > width) width = lanes[l]->size;
  const int per_phase = width <= 4 ? 32 : (width == 8 ? 16 : 8);
  total = ideal = 0;
  for (int p0 = 0; p0 < 32; p0 += per_phase) {
    uintptr_t words[32 * 4];
    int n = 0;
    for (int l = p0; l < p0 + per_phase; ++l) {
      if (!lanes[l]) continue;
      for (uintptr_t w = lanes[l]->addr >> 2; w <= (lanes[l]->addr + lanes[l]->size - 1) >> 2; ++w) words[n++] = w;
    }
    if (n == 0) continue;
    std::sort(words, words + n);
    n = static_cast<int>(std::unique(words, words + n) - words);
    int per_bank[32] = {};
    int worst = 0;
    for (int i = 0; i < n; ++i) worst = std::max(worst, ++per_bank[words[i] & 31]);
    total += static_cast<uint64_t>(worst);
    ideal += static_cast<uint64_t>((n + 31) / 32);
  }
}

// Sectors touched and the ideal sector count of one global-memory warp instruction.
inline void global_sectors(const Access* const lanes[32], uint64_t& sectors, uint64_t& ideal) {
  uintptr_t secs[32 * 2];
  std::pair<uintptr_t, uintptr_t> spans[32];
  int ns = 0, nb = 0;
  for (int l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    const uintptr_t lo = lanes[l]->addr, hi = lo + lanes[l]->size;
    for (uintptr_t s = lo >> 5; s <= (hi - 1) >> 5; ++s) secs[ns++] = s;
    spans[nb++] = {lo, hi};
  }
  std::sort(secs, secs + ns);
  sectors = static_cast<uint64_t>(std::unique(secs, secs + ns) - secs);
  std::sort(spans, spans + nb);
  uint64_t bytes = 0;
  uintptr_t end = 0;
  for (int i = 0; i < nb; ++i) {
    const uintptr_t lo = std::max(spans[i].first, end);
    if (spans[i].second > lo) bytes += spans[i].second - lo;
    end = std::max(end, spans[i].second);
  }
  ideal = (bytes + 31) / 32;
}

// Zips the sequences of one warp's lanes (lanes[l] null for a lane that does not exist), adds the instructions'
// costs to `t`, and clears the sequences.
inline void zip_warp(std::vector<Access>* const lanes[32], Tally& t) {
  struct Item {
    uint32_t pc, k;
    uint8_t lane, flags;
    const Access* a;
  };
  std::vector<Item> items;
  const std::vector<Access>* ref = nullptr;
  bool aligned = true;
  size_t accesses = 0;
  std::vector<uint32_t> ref_pcs, pcs;
  std::unordered_map<uint64_t, uint32_t> seen;
  for (int l = 0; l < 32; ++l) {
    const std::vector<Access>* seq = lanes[l];
    if (!seq || seq->empty()) continue;
    accesses += seq->size();
    // The lane's instruction sequence: code addresses, repeats in a row merged (the pieces of one wide copy, the
    // two sides of one emulated instruction).
    pcs.clear();
    for (const Access& a : *seq)
      if (pcs.empty() || pcs.back() != a.pc) pcs.push_back(a.pc);
    if (ref == nullptr) {
      ref = seq;
      ref_pcs = pcs;
    } else if (aligned) {
      aligned = pcs == ref_pcs;
    }
    seen.clear();
    for (const Access& a : *seq) {
      const uint64_t key = (uint64_t(a.pc) << 8) | a.flags;
      items.push_back(Item{a.pc, seen[key]++, static_cast<uint8_t>(l), a.flags, &a});
    }
  }
  if (items.empty()) return;
  if (!aligned) {
    t.misaligned_segments += 1;
    t.misaligned_accesses += accesses;
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.pc != b.pc) return a.pc < b.pc;
    if (a.flags != b.flags) return a.flags < b.flags;
    if (a.k != b.k) return a.k < b.k;
    return a.lane < b.lane;
  });
  for (size_t i = 0; i < items.size();) {
    size_t j = i;
    const Access* inst[32] = {};
    while (j < items.size() && items[j].pc == items[i].pc && items[j].k == items[i].k &&
           items[j].flags == items[i].flags) {
      inst[items[j].lane] = items[j].a;
      ++j;
    }
    AccessCounts c;
    if (items[i].flags & kShared) {
      c.shared_instructions = 1;
      shared_wavefronts(inst, c.shared_wavefronts, c.shared_wavefronts_ideal);
    } else {
      c.global_instructions = 1;
      global_sectors(inst, c.global_sectors, c.global_sectors_ideal);
    }
    t.total.add(c);
    t.by_pc[items[i].pc].add(c);
    i = j;
  }
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) lanes[l]->clear();
}

}  // namespace model
}  // namespace simt
}  // namespace dspark
