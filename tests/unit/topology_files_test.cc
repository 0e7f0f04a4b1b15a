// Topology parsing against a fake /sys and /etc tree.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "topology/system_files.h"

namespace epfabric::daemon::topology {
namespace {

namespace fs = std::filesystem;

class FakeRoot : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("epf-sysfs-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& relative, const std::string& content) {
    const fs::path path = root_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << content;
  }
  std::string root() const { return root_.string(); }

  fs::path root_;
};

TEST_F(FakeRoot, HostIdPrefersOverrideThenMachineIdThenBootId) {
  EXPECT_EQ(ReadHostId(root(), ""), "");
  Write("proc/sys/kernel/random/boot_id", "5f0e-boot\n");
  EXPECT_EQ(ReadHostId(root(), ""), "5f0e-boot");
  Write("etc/machine-id", "  0123456789abcdef\n");
  EXPECT_EQ(ReadHostId(root(), ""), "0123456789abcdef");
  EXPECT_EQ(ReadHostId(root(), "node-7"), "node-7");
}

TEST_F(FakeRoot, GpuNumaNodeAndCpus) {
  Write("sys/bus/pci/devices/0000:18:00.0/numa_node", "1\n");
  Write("sys/bus/pci/devices/0000:18:00.0/local_cpulist", "16-31,48-63\n");
  Write("sys/bus/pci/devices/0000:2a:00.0/numa_node", "-1\n");
  // CUDA reports upper-case hex, NVML an 8-digit domain: both find the sysfs entry.
  EXPECT_EQ(ReadPciNumaNode(root(), "0000:18:00.0"), 1);
  EXPECT_EQ(ReadPciNumaNode(root(), "00000000:18:00.0"), 1);
  EXPECT_EQ(ReadPciNumaNode(root(), "0000:2A:00.0"), -1);
  EXPECT_EQ(ReadPciNumaNode(root(), "0000:99:00.0"), -1);
  EXPECT_EQ(ReadPciLocalCpuList(root(), "0000:18:00.0"), "16-31,48-63");
  EXPECT_EQ(ReadPciLocalCpuList(root(), "0000:99:00.0"), "");
}

TEST_F(FakeRoot, RdmaDevicePciAddressAndNuma) {
  Write("sys/devices/pci0000:3a/0000:3b:00.0/numa_node", "0\n");
  fs::create_directories(root_ / "sys/class/infiniband/mlx5_0");
  fs::create_symlink("../../../devices/pci0000:3a/0000:3b:00.0", root_ / "sys/class/infiniband/mlx5_0/device");
  EXPECT_EQ(ReadRdmaDevicePciAddress(root(), "mlx5_0"), "0000:3b:00.0");
  EXPECT_EQ(ReadRdmaDeviceNumaNode(root(), "mlx5_0"), 0);
  EXPECT_EQ(ReadRdmaDevicePciAddress(root(), "mlx5_9"), "");
  EXPECT_EQ(ReadRdmaDeviceNumaNode(root(), "mlx5_9"), -1);
}

TEST(NormalizePciBusId, Forms) {
  EXPECT_EQ(NormalizePciBusId("00000000:18:00.0"), "0000:18:00.0");
  EXPECT_EQ(NormalizePciBusId("0000:AB:00.0"), "0000:ab:00.0");
  EXPECT_EQ(NormalizePciBusId("0001:18:00.0"), "0001:18:00.0");
  EXPECT_EQ(NormalizePciBusId("garbage"), "garbage");
}

TEST(FormatGid, Ipv6Notation) {
  const uint8_t zero[16] = {};
  EXPECT_EQ(FormatGid(zero), "");
  const uint8_t link_local[16] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x1b, 0x21, 0xff, 0xfe, 0x3c, 0x4d, 0x5e};
  EXPECT_EQ(FormatGid(link_local), "fe80::21b:21ff:fe3c:4d5e");
  const uint8_t roce_v4[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7};
  EXPECT_EQ(FormatGid(roce_v4), "::ffff:10.0.0.7");
}

TEST(FormatGpuUuid, NvidiaForm) {
  const uint8_t bytes[16] = {0x1a, 0x2b, 0x3c, 0x4d, 0x5e, 0x6f, 0x70, 0x81,
                             0x92, 0xa3, 0xb4, 0xc5, 0xd6, 0xe7, 0xf8, 0x09};
  EXPECT_EQ(FormatGpuUuid(bytes), "GPU-1a2b3c4d-5e6f-7081-92a3-b4c5d6e7f809");
}

}  // namespace
}  // namespace epfabric::daemon::topology
