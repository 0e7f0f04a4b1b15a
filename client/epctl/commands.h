// epctl's verbs, one function each, separated from main() so that parsing and formatting are tested without a
// daemon. Every verb speaks plain text by default and JSON with --json.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "epctl/json_contract.h"
#include "epfabric/v1/control.pb.h"
#include "epfabric/v1/ops.pb.h"

namespace epfabric::epctl {

// Where to reach the daemon and how to print.
struct GlobalOptions {
  std::string socket;   // Unix socket path (clients and local tooling)
  std::string address;  // host:port of the peer port (remote tooling)
  int timeout_ms = 5000;
  bool json = false;
  std::string service;  // health: which service ("" = the daemon as a whole)
  int wait_ms = 0;      // health: ask again until SERVING or this many ms have passed
  std::string command;  // schema: the command whose --json schema to print
  // create-group / delete-group.
  std::string group;
  std::string ranks;  // "0,1,2"
  uint64_t nvl_bytes = 0;
  uint64_t rdma_bytes = 0;
  bool low_latency = false;
  uint64_t normal_bytes = 0;        // create-group --low_latency: the normal-mode part of each NVL region
  uint64_t normal_rdma_bytes = 0;   // ... and of each RDMA region (across hosts)
  bool force = false;               // delete-group without the token (operators)
  uint32_t transport_channels = 0;  // 0: the daemon's default
  uint32_t ring_slots = 0;
  std::string sharing;  // "", "posix_fd", "cuda_ipc", "posix_shm"
  std::string token;
  // Mutual TLS towards a peer port that requires it (--address only): all three or none.
  std::string tls_ca, tls_cert, tls_key;
  // The name to check in the daemon's certificate instead of the dialled host (a pod IP has no name in it).
  std::string tls_target_name;
  // Fabric secret towards a peer port on loopback (--address only): epctl proves itself as ops tooling.
  std::string fabric_secret_file;
  std::string fabric_id = "epfabric";
  // stats: repeat every interval_ms, `count` times (0: until interrupted).
  bool watch = false;
  int interval_ms = 2000;
  int count = 0;
};

// Channel credentials for the options: TLS when the files are given (read here), else insecure.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(const GlobalOptions& options);

// Exactly one of --socket / --address; a positive timeout.
absl::Status ValidateGlobalOptions(const GlobalOptions& options);

// The gRPC target for the options: "unix:PATH" or "HOST:PORT".
std::string TargetOf(const GlobalOptions& options);

struct Command {
  std::string name;
  std::string summary;  // one line for the command list
  std::string help;     // `epctl NAME --help`
  // Runs the verb; returns the process exit code. Errors go to `err` as one line.
  std::function<int(const GlobalOptions&, const std::shared_ptr<grpc::Channel>&, std::ostream& out, std::ostream& err)>
      run;
};

const std::vector<Command>& Commands();
const Command* FindCommand(const std::string& name);

// Builds a CreateGroup request from the options; errors name the flag.
absl::StatusOr<v1::CreateGroupRequest> CreateGroupRequestFrom(const GlobalOptions& options);

// The JSON document each command prints with --json (json_contract.h): its message type and the fields it leaves
// out. `epctl schema --command=NAME` prints the schema; docs/epctl-json/NAME.schema.json holds the same.
struct JsonDocument {
  std::string command;
  const google::protobuf::Descriptor* type;
  OmittedFields omitted;
};
const std::vector<JsonDocument>& JsonDocuments();
const OmittedFields& OmittedFor(const std::string& command);

// False for verbs that answer without a daemon (schema).
bool NeedsDaemon(const std::string& command);

// Shared by the verbs' files.
std::string ToJson(const google::protobuf::Message& message, const OmittedFields& omitted = {});
// The error of a Control verb (create-group, delete-group, groups) given --address.
std::string ControlOnlyOnSocket(const std::string& command);
void SetDeadline(grpc::ClientContext& context, const GlobalOptions& options);
std::string RpcError(const std::string& what, const GlobalOptions& options, const grpc::Status& status);

// Verbs in ops_commands.cc.
int RunGroups(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err);
int RunLeases(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
              std::ostream& err);
int RunStats(const GlobalOptions& options, const std::shared_ptr<grpc::Channel>& channel, std::ostream& out,
             std::ostream& err);

// Readable forms of groups, leases (`now_unix`: for "N s ago") and stats.
std::string FormatGroups(const v1::ListGroupsResponse& groups);
std::string FormatLeases(const v1::ListClientsResponse& clients, int64_t now_unix);
std::string FormatStats(const v1::Stats& stats);

// The readable forms of a health report and a fabric view.
std::string FormatHealthReport(const v1::HealthReport& report);
std::string FormatFabric(const v1::FabricView& fabric);

// The readable form of a topology: host, daemon, GPUs, GPU-to-GPU matrix, NICs.
std::string FormatTopology(const v1::Topology& topology);

// The peer matrix cell for one ordered GPU pair: "X" (self), "NV<n>", "P2P" (peer access without NVLink, or
// NVLink unknown), "-" (no peer access).
std::string LinkCell(const v1::GpuLink* link);

}  // namespace epfabric::epctl
