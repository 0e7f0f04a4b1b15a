// The verbs wire's decisions as pure functions of plain data, so that they are unit-tested on machines without an
// RDMA NIC (CI, this repository's build hosts): the endpoint carried in TransportEndpoint.rdma and its validation
// (peers are untrusted), the choice of device, port and GID, the memory registration path, the queue pair
// attributes of each state transition, queue sizes, and the mapping of work completion errors to absl::Status.
// verbs_resources.cc and verbs_wire.cc only apply what these return.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "epfabric/v1/peer.pb.h"
#include "transport/verbs/verbs_probe.h"

namespace epfabric::daemon::transport::verbs {

using Gid = std::array<uint8_t, 16>;

// Queue pair numbers and packet sequence numbers are 24-bit fields on the wire.
inline constexpr uint32_t kMax24Bit = 0xFFFFFF;

// What a member publishes so that its peers can reach its region: TransportEndpoint.rdma plus region_bytes.
struct EndpointData {
  int rank = -1;
  uint64_t address = 0;       // the region's address in the member's registration (the iova peers write to)
  uint64_t region_bytes = 0;  // TransportEndpoint.region_bytes
  uint32_t rkey = 0;
  // Index = peer rank * channels + channel: the member's queue pair that talks to that peer on that channel. The
  // member's own slots hold loopback queue pairs (connected to themselves), so that a rank's puts and signals to
  // itself take the same path, and the same ordering and atomicity, as those to others.
  std::vector<uint32_t> qp_numbers;
  std::vector<uint32_t> psns;
  Gid gid{};
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_1024;
  uint32_t gid_index = 0;
  uint32_t port = 1;
  bool roce = false;
};

inline int QpIndex(int peer, int channel, int channels) { return peer * channels + channel; }

// Writes `data` into `out` (transport = TRANSPORT_VERBS, region_bytes, rdma).
void FillEndpoint(const EndpointData& data, v1::TransportEndpoint* out);

// What this member expects of every peer's endpoint.
struct EndpointExpectations {
  int rank = -1;  // the group rank the endpoint was received for
  int world = 0;
  int channels = 1;
  bool roce = false;  // this member's link layer: both ends must route the same way
};

// Reads a peer's endpoint. Everything in it came from another daemon, so every field is checked: InvalidArgument
// naming the rank and the field (e.g. "rank 2: rdma.gid has 4 bytes, expected 16") for a wrong transport or rank,
// qp_numbers/psns counts other than world * channels, 24-bit overflows, a GID that is not 16 bytes (or all zero on
// RoCE), an MTU outside IBV_MTU_256..IBV_MTU_4096, an InfiniBand LID outside the unicast range, a port outside
// 1..255, or an address range that wraps; FailedPrecondition when the link layers differ.
absl::StatusOr<EndpointData> ParseEndpoint(const v1::TransportEndpoint& endpoint, const EndpointExpectations& expect);

// --- Device, port and GID -----------------------------------------------------------------------------------------

struct GidInfo {
  uint32_t index = 0;
  Gid gid{};
  ibv_gid_type type = IBV_GID_TYPE_IB;
};

struct PortInfo {
  uint8_t port = 1;
  bool active = false;
  bool ethernet = false;  // link layer Ethernet (RoCE); otherwise InfiniBand
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint16_t lid = 0;
  std::vector<GidInfo> gids;  // the valid entries of the port's GID table
};

struct DeviceInfo {
  std::string name;
  std::vector<PortInfo> ports;
};

struct PortChoice {
  std::string device;
  uint8_t port = 1;
  bool roce = false;
  uint32_t gid_index = 0;
  Gid gid{};
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_1024;
};

// The RoCE v2 GID to route by: an IPv4-mapped one (::ffff:a.b.c.d) first, then a global IPv6 one, then a
// link-local one; never RoCE v1, never an all-zero entry. nullopt when the port has none.
std::optional<GidInfo> ChooseRoceV2Gid(const std::vector<GidInfo>& gids);

// The device, port and GID the options select among `devices` (what ibv_get_device_list and the queries found).
// FailedPrecondition with one line starting "--transport=verbs: " when nothing fits.
absl::StatusOr<PortChoice> ChoosePort(const VerbsOptions& options, const std::vector<DeviceInfo>& devices);

// "mlx5_0 port 1 (RoCE v2, gid index 3)" / "mlx5_0 port 1 (InfiniBand, lid 7)".
std::string DescribePort(const PortChoice& choice);

// --- Memory registration ------------------------------------------------------------------------------------------

enum class RegistrationPath {
  kHostRegMr,     // host memory: ibv_reg_mr
  kDmaBuf,        // device memory: cuMemGetHandleForAddressRange(DMA_BUF_FD) + ibv_reg_dmabuf_mr
  kPeerMemRegMr,  // device memory: ibv_reg_mr on the device pointer, which works only with nvidia-peermem loaded
};

absl::string_view RegistrationPathName(RegistrationPath path);

struct RegistrationCaps {
  bool device_memory = false;     // the region is CUDA device memory (descriptor().device >= 0)
  bool dmabuf_supported = false;  // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and the driver entry point exists
  bool allow_peermem = true;      // VerbsOptions::allow_peermem
};

// The paths to try, in order, until one registers. Empty only for device memory without DMA-BUF when peermem is
// not allowed (the caller says so).
std::vector<RegistrationPath> RegistrationOrder(const RegistrationCaps& caps);

// cuMemGetHandleForAddressRange wants a host-page-aligned range; ibv_reg_dmabuf_mr then takes the offset of the
// region inside it.
struct DmaBufRange {
  uint64_t start = 0;   // page-aligned address of the exported range
  uint64_t size = 0;    // page-aligned size of the exported range
  uint64_t offset = 0;  // region base - start
};
DmaBufRange DmaBufRangeFor(uint64_t base, uint64_t bytes, uint64_t page_size);

// --- Queue pairs --------------------------------------------------------------------------------------------------

// What a queue pair allows its peer: write, read and atomics on the region; LOCAL_WRITE for the atomic results.
// Relaxed ordering is deliberately absent: with it PCIe may let a signal's atomic pass the data written before it.
inline constexpr int kRegionAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

struct QpTransition {
  ibv_qp_attr attr{};
  int mask = 0;
};

// RESET -> INIT.
QpTransition InitTransition(uint8_t port);
// INIT -> RTR towards `remote` (whose queue pair `remote_qpn` starts at `remote_psn`). RoCE routes by GID
// (is_global, sgid_index = the local GID index, the remote GID, traffic class, hop limit); InfiniBand by LID.
// The path MTU is the smaller of both ports' MTUs.
QpTransition RtrTransition(const PortChoice& local, const EndpointData& remote, uint32_t remote_qpn,
                           uint32_t remote_psn, const VerbsOptions& options, int max_dest_rd_atomic);
// RTR -> RTS.
QpTransition RtsTransition(uint32_t local_psn, const VerbsOptions& options, int max_rd_atomic);

struct QueueSizes {
  int send_queue_depth = 0;
  int cq_entries = 0;
};
// Every work request is signaled, so the completion queue must hold one entry per send slot of every queue pair:
// the depth is cut to what both the device's max_qp_wr and max_cqe allow. InvalidArgument for num_qps < 1 or a
// requested depth < 1; ResourceExhausted when not even a depth of 1 fits.
absl::StatusOr<QueueSizes> SizeQueues(int num_qps, int requested_depth, int max_qp_wr, int max_cqe);

// A put longer than the port's max_msg_sz (and than an SGE's 32-bit length) is posted as several writes.
uint64_t MaxWriteBytes(uint32_t port_max_msg_sz);
uint64_t WriteCount(uint64_t bytes, uint64_t max_write_bytes);  // at least 1 (a 0-byte put is one empty write)

// --- Completions ---------------------------------------------------------------------------------------------------

// Unavailable: the peer cannot be reached (retries exhausted, remote aborted, flushed); PermissionDenied: a key or
// an access right was refused (local or remote); InvalidArgument: a request the responder or our HCA found
// malformed (length, alignment); Internal: the rest (fatal, local QP errors). OK for IBV_WC_SUCCESS.
absl::StatusCode CodeForWcStatus(ibv_wc_status status);

// "verbs: group g, rank 3, channel 1: RDMA WRITE failed: transport retry counter exceeded (status 12, vendor
// error 0x81)" with CodeForWcStatus's code.
absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_error, absl::string_view group, int peer,
                              int channel, absl::string_view operation);

}  // namespace epfabric::daemon::transport::verbs
