// Reading the kernel timelines that the kernels write when a benchmark passes `profile_ns` (see
// kProfileSlotsPerBlock in epfabric/kernels/common.h): where inside a kernel the time goes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace epfabric::bench {

// One kernel run: per block, kProfileSlotsPerBlock %globaltimer values (0 = not written).
struct Timeline {
  std::vector<uint64_t> slots;
  int num_blocks = 0;

  uint64_t Start() const;  // earliest block entry
  uint64_t End() const;    // latest warp end
  // Latest end among warps [first, last) of every block, in microseconds after Start(); 0 when none wrote.
  double WarpsEndUs(int first, int last) const;
  // The last block's entry (slot 0), in microseconds after Start(): how long the grid took to start.
  double LastEntryUs() const;
  // Slot 1 over blocks, in microseconds after Start(): the latest one.
  double Slot1MaxUs() const;
  double DurationUs() const { return (End() - Start()) / 1e3; }
};

// A role = a named range of warps of every block.
struct WarpRole {
  std::string name;
  int first_warp, last_warp;     // [first, last)
  std::string suffix = " done";  // printed after the name
};

// The low-latency kernels' steps (kernels::LowLatencyStep) as rows of a timeline: each is the latest time a warp of any
// block reached the step; then the last warp end. `combine` picks the combine kernel's steps, else the dispatch's.
std::vector<WarpRole> LowLatencyStepRoles(bool combine);

// Prints one line per measure (median over `runs`, with p10 and p90, microseconds after the kernel's first block
// entry): the start-up (slot 1), each role's last warp end, the whole kernel; and, when `previous` holds the
// previous kernel on the same stream for every run, the gap from its end to this kernel's start. A measure that no
// run recorded (slot 1 or a step of the other phase in a low-latency hook launch) gets no line.
void PrintTimelines(const std::string& title, const std::vector<Timeline>& runs, const std::vector<WarpRole>& roles,
                    const std::vector<Timeline>* previous = nullptr);

}  // namespace epfabric::bench
