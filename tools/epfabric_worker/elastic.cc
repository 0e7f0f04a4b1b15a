// epfabric_worker --elastic_dir (elastic.h): survivors and a replacement rejoining at a round the orchestrator picks.
#include "elastic.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "checks.h"

namespace epfabric::worker {
namespace {

// The whole file as written by the orchestrator (written to a temporary name, then renamed): -1 while absent.
int ReadRound(const std::string& path) {
  std::ifstream in(path);
  if (!in) return -1;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int value = -1;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) ? value : -1;
}

void WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text << "\n";
  std::filesystem::rename(tmp, path);
}

absl::Status RunFullStrengthRound(Buffer& buffer, Memory& mem, const Scenario& s, int round, Checks& checks,
                                  ElasticOutcome* out) {
  RoundStats stats;
  if (absl::Status ran = RunLowLatencyRound(buffer, mem, s, round, checks, &stats); !ran.ok()) return ran;
  ++out->rounds;
  if (!stats.masked.empty()) {
    return absl::InternalError(absl::StrCat("round ", round, ", after the rejoin, ran with rank(s) ",
                                            absl::StrJoin(stats.masked, ","), " masked"));
  }
  ++out->full_rounds_after;
  return absl::OkStatus();
}

absl::Status Rejoin(Buffer& buffer, int round, ElasticOutcome* out) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status rejoined = buffer.Rejoin(); !rejoined.ok()) return rejoined;
  out->rejoin_ms = MsSince(start);
  out->rejoin_round = round;
  std::cout << "EPF_EVENT rank=" << buffer.rank() << " rejoined round=" << round << " rejoin_ms=" << out->rejoin_ms
            << std::endl;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunElastic(Buffer& buffer, Memory& mem, const Scenario& s, const ElasticOptions& options, Checks& checks,
                        ElasticOutcome* out) {
  const int rank = buffer.rank();
  const std::string rejoin_file = options.dir + "/rejoin_at";
  const absl::Time deadline = absl::Now() + options.max_time;
  if (options.replacement) {
    WriteFileAtomically(absl::StrCat(options.dir, "/attached.", rank), "1");
    std::cout << "EPF_EVENT rank=" << rank << " attached unix_ns=" << absl::GetCurrentTimeNanos() << std::endl;
    int at = -1;
    while ((at = ReadRound(rejoin_file)) < 0) {
      if (absl::Now() > deadline) return absl::DeadlineExceededError("no " + rejoin_file + " within the run's bound");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (absl::Status rejoined = Rejoin(buffer, at, out); !rejoined.ok()) return rejoined;
    for (int round = at; round < at + options.rounds_after; ++round) {
      if (absl::Status ran = RunFullStrengthRound(buffer, mem, s, round, checks, out); !ran.ok()) return ran;
    }
    return absl::OkStatus();
  }
  bool reported_waiting = false;
  int at = -1;
  for (int round = 0;; ++round) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no rejoin within the run's bound (round ", round, ")"));
    }
    if (!reported_waiting) {
      if (const std::vector<int> waiting = buffer.RanksWaitingToRejoin(); !waiting.empty()) {
        reported_waiting = true;
        std::cout << "EPF_EVENT rank=" << rank << " waiting_seen round=" << round
                  << " ranks=" << absl::StrJoin(waiting, ",") << std::endl;
        WriteFileAtomically(absl::StrCat(options.dir, "/waiting_seen.", rank), absl::StrCat(round));
      }
    }
    if (at < 0) at = ReadRound(rejoin_file);
    if (at >= 0) {
      if (round > at && out->rejoin_round < 0) {
        return absl::FailedPreconditionError(absl::StrCat("the rejoin round ", at, " came after round ", round - 1));
      }
      if (round == at) {
        if (absl::Status rejoined = Rejoin(buffer, round, out); !rejoined.ok()) return rejoined;
        for (; round < at + options.rounds_after; ++round) {
          if (absl::Status ran = RunFullStrengthRound(buffer, mem, s, round, checks, out); !ran.ok()) return ran;
        }
        return absl::OkStatus();
      }
    }
    RoundStats stats;
    if (absl::Status ran = RunLowLatencyRound(buffer, mem, s, round, checks, &stats); !ran.ok()) return ran;
    ++out->rounds;
    if (round == 0) std::cout << "EPF_EVENT rank=" << rank << " running" << std::endl;
    if (!stats.masked.empty()) ++out->masked_rounds;
    if (stats.first_masked_ok_unix_ns != 0 && out->first_masked_ok_unix_ns == 0) {
      out->first_masked_ok_unix_ns = stats.first_masked_ok_unix_ns;
      std::cout << "EPF_EVENT rank=" << rank << " masked_ok round=" << round
                << " unix_ns=" << stats.first_masked_ok_unix_ns << " ranks=" << absl::StrJoin(stats.masked, ",")
                << std::endl;
    }
    if (options.round_pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(options.round_pause_ms));
  }
}

}  // namespace epfabric::worker
