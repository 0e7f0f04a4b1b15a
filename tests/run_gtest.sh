#!/usr/bin/env bash
# Runs one GoogleTest binary for ctest (tests/CMakeLists.txt, epf_add_test) and turns its result into ctest's:
#   - the binary's own exit status when it is not 0 (a failed case), or its death by the same signal (a crash):
#     ctest reports a failure, whatever else the binary printed;
#   - 77 (the tests' SKIP_RETURN_CODE) when it exited 0 and its report lists at least one skipped case and no failed
#     one: nothing failed and something skipped (a GPU test without a GPU, a case that does not apply here);
#   - 0 otherwise.
# The binary writes to this script's stdout and stderr directly; what was skipped or failed is read from GoogleTest's
# XML report (--gtest_output), written to a temporary file, so no pipe can hold the run open after the binary exits.
#
# Usage: run_gtest.sh BINARY [ARGS...]
set -uo pipefail

readonly kSkipCode=77
if (($# < 1)); then
  echo "usage: $0 BINARY [ARGS...]" >&2
  exit 2
fi
report=$(mktemp "${TMPDIR:-/tmp}/epf-gtest.XXXXXX.xml") || exit 2
trap 'rm -f "$report"' EXIT

"$@" --gtest_output="xml:$report"
status=$?
if ((status > 128 && status <= 128 + 64)); then
  # Killed by a signal: die of the same one, so that ctest names it (e.g. "Exception: SegFault") as for the binary.
  rm -f "$report"
  trap - EXIT "$((status - 128))"
  kill -s "$((status - 128))" "$$"
fi
((status == 0)) || exit "$status"

# GoogleTest writes one <testcase> per case: result="skipped" for GTEST_SKIP, a <failure> element per failed check.
skipped=$(grep -c 'result="skipped"' "$report" 2>/dev/null)
failed=$(grep -c '<failure' "$report" 2>/dev/null)
if ((${skipped:-0} > 0 && ${failed:-0} == 0)); then
  echo "run_gtest.sh: ${skipped} case(s) skipped, none failed: reported to ctest as skipped (exit ${kSkipCode})"
  exit "$kSkipCode"
fi
exit 0
