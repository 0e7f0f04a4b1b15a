// Scenarios shared by the host backend's thread and process tests: deterministic random inputs for every rank, the
// expected results from the host references, and the per-rank sequence of host-backend calls with an element-by-
// element comparison. A rank's function runs in a thread (host_backend_test) or in a child process
// (host_backend_process_test); it returns the mismatches it found (empty = all equal) and always issues the whole
// sequence of calls, so that one rank's mismatch does not leave its peers waiting.
#pragma once

#include "host_backend_common_scenarios.h"
#include "host_backend_intranode_scenarios.h"
#include "host_backend_low_latency_scenarios.h"
