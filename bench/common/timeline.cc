#include "common/timeline.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "common/report.h"
#include "epfabric/kernels/common.h"

namespace epfabric::bench {
namespace {

constexpr int kSlots = kernels::kProfileSlotsPerBlock;

}  // namespace

uint64_t Timeline::Start() const {
  uint64_t start = std::numeric_limits<uint64_t>::max();
  for (int b = 0; b < num_blocks; ++b) {
    const uint64_t v = slots[static_cast<size_t>(b) * kSlots];
    if (v != 0) start = std::min(start, v);
  }
  return start;
}

uint64_t Timeline::End() const {
  uint64_t end = 0;
  for (int b = 0; b < num_blocks; ++b) {
    for (int s = 2; s < kSlots; ++s) end = std::max(end, slots[static_cast<size_t>(b) * kSlots + s]);
  }
  return end;
}

double Timeline::WarpsEndUs(int first, int last) const {
  uint64_t end = 0;
  for (int b = 0; b < num_blocks; ++b) {
    for (int w = first; w < last && 2 + w < kSlots; ++w)
      end = std::max(end, slots[static_cast<size_t>(b) * kSlots + 2 + w]);
  }
  return end == 0 ? 0 : (end - Start()) / 1e3;
}

double Timeline::LastEntryUs() const {
  uint64_t last = 0;
  for (int b = 0; b < num_blocks; ++b) last = std::max(last, slots[static_cast<size_t>(b) * kSlots]);
  return last == 0 ? 0 : (last - Start()) / 1e3;
}

double Timeline::Slot1MaxUs() const {
  uint64_t end = 0;
  for (int b = 0; b < num_blocks; ++b) end = std::max(end, slots[static_cast<size_t>(b) * kSlots + 1]);
  return end == 0 ? 0 : (end - Start()) / 1e3;
}

void PrintTimelines(const std::string& title, const std::vector<Timeline>& runs, const std::vector<WarpRole>& roles,
                    const std::vector<Timeline>* previous) {
  auto line = [&](const std::string& what, std::vector<double> v) {
    const Summary s = Summarize(std::move(v));
    std::printf("  %-36s %8.2f us  (p10 %7.2f, p90 %7.2f)\n", what.c_str(), s.median, s.p10, s.p90);
  };
  std::printf("timeline %s (%zu runs; us after the first block started)\n", title.c_str(), runs.size());
  std::vector<double> v;
  for (const Timeline& t : runs) v.push_back(t.LastEntryUs());
  line("last block entered", v);
  v.clear();
  for (const Timeline& t : runs) v.push_back(t.Slot1MaxUs());
  if (std::any_of(v.begin(), v.end(), [](double us) { return us != 0; }))
    line("start-up / send phase done (slot 1)", v);
  for (const WarpRole& role : roles) {
    v.clear();
    for (const Timeline& t : runs) v.push_back(t.WarpsEndUs(role.first_warp, role.last_warp));
    // A role no warp played in any run (a step of the other phase in a hook launch) gets no line.
    if (std::all_of(v.begin(), v.end(), [](double us) { return us == 0; })) continue;
    line(role.name + role.suffix, v);
  }
  v.clear();
  for (const Timeline& t : runs) v.push_back(t.DurationUs());
  line("kernel (first entry to last warp end)", v);
  if (previous != nullptr && previous->size() == runs.size()) {
    v.clear();
    for (size_t i = 0; i < runs.size(); ++i)
      v.push_back((static_cast<double>(runs[i].Start()) - (*previous)[i].End()) / 1e3);
    line("gap after the previous kernel", v);
  }
}

std::vector<WarpRole> LowLatencyStepRoles(bool combine) {
  using kernels::LowLatencyStep;
  auto row = [](const char* name, LowLatencyStep step) {
    const int slot = static_cast<int>(step);
    return WarpRole{.name = name, .first_warp = slot - 2, .last_warp = slot - 1, .suffix = ""};
  };
  const WarpRole all_warps{.name = "all warps", .first_warp = 0, .last_warp = kernels::kProfileSlotsPerBlock - 2};
  if (combine) {
    return {row("weights published (block 0)", LowLatencyStep::kCombineWeightsSent),
            row("own tokens' partial rows stored", LowLatencyStep::kCombineOwnRowsSent),
            row("peers' weights seen", LowLatencyStep::kCombineWeightsArrived),
            row("an item's rows and weights in hand", LowLatencyStep::kCombineRowsGathered),
            row("peers' tokens' partial rows stored", LowLatencyStep::kCombinePeerRowsSent),
            row("all items counted (block 0)", LowLatencyStep::kCombineItemsCounted),
            row("combine flags raised (block 0)", LowLatencyStep::kCombineFlagsSent),
            row("combine flags seen (every block)", LowLatencyStep::kCombineFlagsArrived),
            all_warps};
  }
  return {row("data pieces stored", LowLatencyStep::kDispatchDataStored),
          row("routing tables written", LowLatencyStep::kDispatchTableWritten),
          row("all data items counted (routing)", LowLatencyStep::kDispatchItemsCounted),
          row("counts published", LowLatencyStep::kDispatchCountSent),
          row("counts seen (receivers)", LowLatencyStep::kDispatchCountsArrived),
          all_warps};
}

}  // namespace epfabric::bench
