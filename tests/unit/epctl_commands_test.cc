#include <gtest/gtest.h>

#include "epctl/commands.h"

namespace epfabric::epctl {
namespace {

v1::Topology TwoGpusWithNvLink() {
  v1::Topology t;
  t.set_host_id("host-1");
  t.set_hostname("gpu-node");
  t.mutable_daemon()->set_rank(1);
  t.mutable_daemon()->set_world_size(2);
  t.mutable_daemon()->set_backend(v1::BACKEND_CUDA);
  t.mutable_daemon()->set_device(1);
  for (int i = 0; i < 2; ++i) {
    v1::Gpu* g = t.add_gpus();
    g->set_ordinal(i);
    g->set_name("NVIDIA H200");
    g->set_uuid("GPU-" + std::to_string(i));
    g->set_pci_bus_id(i == 0 ? "0000:18:00.0" : "0000:2a:00.0");
    g->set_memory_bytes(150'000'000'000ull);
    g->set_sm_count(132);
    g->set_cc_major(9);
    g->set_numa_node(i);
  }
  for (auto [from, to] : {std::pair{0, 1}, std::pair{1, 0}}) {
    v1::GpuLink* l = t.add_gpu_links();
    l->set_from(from);
    l->set_to(to);
    l->set_peer_access(true);
    l->set_nvlink_known(true);
    l->set_nvlink_links(18);
  }
  v1::RdmaNic* nic = t.add_nics();
  nic->set_name("mlx5_0");
  nic->set_pci_address("0000:3b:00.0");
  v1::RdmaPort* port = nic->add_ports();
  port->set_port(1);
  port->set_state("ACTIVE");
  port->set_link_layer("InfiniBand");
  port->set_rate_gbps(400);
  return t;
}

TEST(FormatTopology, ShowsGpusMatrixAndNics) {
  const std::string text = FormatTopology(TwoGpusWithNvLink());
  EXPECT_NE(text.find("host      host-1  gpu-node"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1/2  backend cuda  device 1"), std::string::npos) << text;
  EXPECT_NE(text.find("GPUs (2)"), std::string::npos);
  EXPECT_NE(text.find("NVIDIA H200"), std::string::npos);
  EXPECT_NE(text.find("150.0 GB"), std::string::npos) << text;
  EXPECT_NE(text.find("  GPU0 X      NV18   \n"), std::string::npos) << text;
  EXPECT_NE(text.find("  GPU1 NV18   X      \n"), std::string::npos) << text;
  EXPECT_NE(text.find("mlx5_0"), std::string::npos);
  EXPECT_NE(text.find("port 1 ACTIVE  InfiniBand    400 Gb/s"), std::string::npos) << text;
}

TEST(FormatTopology, EmptyHost) {
  v1::Topology t;
  const std::string text = FormatTopology(t);
  EXPECT_NE(text.find("host      (unknown)"), std::string::npos) << text;
  EXPECT_NE(text.find("GPUs (0)"), std::string::npos);
  EXPECT_EQ(text.find("GPU links"), std::string::npos);
  EXPECT_NE(text.find("RDMA NICs (0)"), std::string::npos);
}

TEST(LinkCell, Kinds) {
  EXPECT_EQ(LinkCell(nullptr), "X");
  v1::GpuLink link;
  EXPECT_EQ(LinkCell(&link), "-");
  link.set_peer_access(true);
  EXPECT_EQ(LinkCell(&link), "P2P");
  link.set_nvlink_links(4);
  EXPECT_EQ(LinkCell(&link), "NV4");
}

TEST(GlobalOptions, ExactlyOneTarget) {
  GlobalOptions o;
  EXPECT_FALSE(ValidateGlobalOptions(o).ok());
  o.socket = "/run/epf.sock";
  EXPECT_TRUE(ValidateGlobalOptions(o).ok());
  EXPECT_EQ(TargetOf(o), "unix:/run/epf.sock");
  o.address = "10.0.0.1:7000";
  EXPECT_FALSE(ValidateGlobalOptions(o).ok());
  o.socket.clear();
  EXPECT_EQ(TargetOf(o), "10.0.0.1:7000");
  o.timeout_ms = 0;
  EXPECT_EQ(ValidateGlobalOptions(o).message(), "--timeout_ms: 0 is not positive");
}

TEST(Commands, EveryCommandHasHelpAndRunner) {
  ASSERT_FALSE(Commands().empty());
  for (const Command& c : Commands()) {
    EXPECT_FALSE(c.summary.empty()) << c.name;
    EXPECT_NE(c.help.find("epctl " + c.name), std::string::npos) << c.name;
    EXPECT_TRUE(static_cast<bool>(c.run)) << c.name;
    EXPECT_EQ(FindCommand(c.name), &c);
  }
  EXPECT_EQ(FindCommand("nope"), nullptr);
}

TEST(FormatFabric, MembersAndGroups) {
  v1::FabricView f;
  f.set_fabric_id("prod");
  f.set_self_rank(1);
  f.set_degraded(true);
  f.mutable_membership()->set_epoch(7);
  f.mutable_membership()->set_world_size(2);
  v1::MemberInfo* up = f.mutable_membership()->add_members();
  up->set_rank(0);
  up->set_state(v1::MEMBER_STATE_UP);
  up->set_peer_address("10.0.0.1:7100");
  up->set_backend(v1::BACKEND_CUDA);
  up->set_incarnation(0xabc);
  v1::MemberInfo* down = f.mutable_membership()->add_members();
  down->set_rank(1);
  down->set_state(v1::MEMBER_STATE_DOWN);
  v1::GroupInfo* g = f.add_groups();
  g->set_name("moe");
  g->set_state(v1::GROUP_STATE_DEGRADED);
  g->add_ranks(0);
  g->add_ranks(1);
  g->set_num_nvl_bytes(1024);
  const std::string text = FormatFabric(f);
  EXPECT_NE(text.find("fabric 'prod'  epoch 7  ranks 2  self rank 1  degraded: yes"), std::string::npos) << text;
  EXPECT_NE(text.find("0     UP       10.0.0.1:7100"), std::string::npos) << text;
  EXPECT_NE(text.find("cuda          -                        0000000000000abc"), std::string::npos) << text;
  EXPECT_NE(text.find("1     DOWN     -"), std::string::npos) << text;
  EXPECT_NE(text.find("moe                      DEGRADED  ranks [0,1]  nvl 1024 B"), std::string::npos) << text;
}

TEST(CreateGroupRequestFrom, ParsesAndNamesBadFlags) {
  GlobalOptions o;
  o.group = "g";
  o.ranks = "0,2,3";
  o.nvl_bytes = 4096;
  o.sharing = "cuda_ipc";
  auto request = CreateGroupRequestFrom(o);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->ranks_size(), 3);
  EXPECT_EQ(request->ranks(2), 3);
  EXPECT_EQ(request->memory_sharing(), v1::MEMORY_SHARING_CUDA_IPC);
  o.ranks = "0,x";
  EXPECT_EQ(CreateGroupRequestFrom(o).status().message(), "--ranks: 'x' is not a rank");
  o.ranks = "0";
  o.sharing = "nvshmem";
  EXPECT_EQ(CreateGroupRequestFrom(o).status().message(),
            "--sharing: 'nvshmem' is not one of posix_fd, cuda_ipc, posix_shm");
  o.sharing = "";
  o.nvl_bytes = 0;
  EXPECT_EQ(CreateGroupRequestFrom(o).status().message(), "--nvl_bytes: required (bytes per member)");
}

}  // namespace
}  // namespace epfabric::epctl

namespace epfabric::epctl {
namespace {

// The --json contract (json_contract.h): .proto order, every field, proto3 JSON values, sorted map keys, omissions.
TEST(ContractJson, FieldsInProtoOrderWithMappingValuesAndSortedMaps) {
  v1::Stats stats;
  stats.set_uptime_seconds(12);
  (*stats.mutable_counters())["z"] = 1;
  (*stats.mutable_counters())["a\"b"] = 18446744073709551615u;
  v1::MetricSample* sample = stats.add_samples();
  sample->set_name("epfabric_rpcs_total");
  (*sample->mutable_labels())["service"] = "s";
  (*sample->mutable_labels())["code"] = "OK";
  sample->set_value(0.5);
  EXPECT_EQ(ContractJson(stats),
            "{\n"
            "  \"uptime_seconds\": \"12\",\n"
            "  \"counters\": {\n"
            "    \"a\\\"b\": \"18446744073709551615\",\n"
            "    \"z\": \"1\"\n"
            "  },\n"
            "  \"samples\": [\n"
            "    {\n"
            "      \"name\": \"epfabric_rpcs_total\",\n"
            "      \"labels\": {\n"
            "        \"code\": \"OK\",\n"
            "        \"service\": \"s\"\n"
            "      },\n"
            "      \"value\": 0.5,\n"
            "      \"type\": \"\"\n"
            "    }\n"
            "  ]\n"
            "}");
}

TEST(ContractJson, UnsetMessagesArePrintedWholeAndOmittedFieldsAreNot) {
  v1::ListClientsResponse clients;
  clients.add_clients()->set_group("g");
  const std::string json = ContractJson(clients, OmittedFor("leases"));
  EXPECT_EQ(json.find("lease_id"), std::string::npos) << json;
  EXPECT_NE(json.find("\"group\": \"g\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"pid\": \"0\""), std::string::npos) << json;
  const std::string schema = ContractSchema(v1::ListClientsResponse::descriptor(), "t", OmittedFor("leases"));
  EXPECT_EQ(schema.find("lease_id"), std::string::npos);
  EXPECT_NE(schema.find("\"additionalProperties\": false"), std::string::npos);
  v1::CreateGroupResponse created;  // group unset: still an object with every key
  EXPECT_NE(ContractJson(created).find("\"group\": {\n    \"name\": \"\""), std::string::npos) << ContractJson(created);
}

TEST(ContractJson, EveryCommandWithJsonHasADocument) {
  for (const Command& command : Commands()) {
    if (command.name == "schema") continue;
    bool found = false;
    for (const JsonDocument& document : JsonDocuments()) found = found || document.command == command.name;
    EXPECT_TRUE(found) << command.name;
  }
}

}  // namespace
}  // namespace epfabric::epctl
