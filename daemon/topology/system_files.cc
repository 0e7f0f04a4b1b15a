#include "topology/system_files.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace epfabric::daemon::topology {
namespace {

namespace fs = std::filesystem;

// The first line of a file, trimmed; "" when the file cannot be read.
std::string ReadFirstLine(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(absl::StripAsciiWhitespace(line));
}

fs::path Under(const std::string& root, const std::string& absolute) {
  return fs::path(root) / fs::path(absolute).relative_path();
}

int ParseNumaNode(const std::string& text) {
  int node = -1;
  if (!absl::SimpleAtoi(text, &node) || node < 0) return -1;
  return node;
}

}  // namespace

std::string ReadHostId(const std::string& root, const std::string& override_id) {
  if (!override_id.empty()) return override_id;
  std::string id = ReadFirstLine(Under(root, "/etc/machine-id"));
  if (id.empty()) id = ReadFirstLine(Under(root, "/proc/sys/kernel/random/boot_id"));
  return id;
}

std::string NormalizePciBusId(const std::string& pci_bus_id) {
  std::string id = absl::AsciiStrToLower(pci_bus_id);
  // domain:bus:device.function; NVML writes an 8-digit domain, CUDA and sysfs 4 digits.
  std::vector<std::string> parts = absl::StrSplit(id, ':');
  if (parts.size() == 3) {
    unsigned int domain = 0;
    if (absl::SimpleHexAtoi(parts[0], &domain)) {
      return absl::StrFormat("%04x:%s:%s", domain, parts[1], parts[2]);
    }
  }
  return id;
}

int ReadPciNumaNode(const std::string& root, const std::string& pci_bus_id) {
  return ParseNumaNode(
      ReadFirstLine(Under(root, "/sys/bus/pci/devices") / NormalizePciBusId(pci_bus_id) / "numa_node"));
}

std::string ReadPciLocalCpuList(const std::string& root, const std::string& pci_bus_id) {
  return ReadFirstLine(Under(root, "/sys/bus/pci/devices") / NormalizePciBusId(pci_bus_id) / "local_cpulist");
}

std::string ReadRdmaDevicePciAddress(const std::string& root, const std::string& ib_device) {
  // /sys/class/infiniband/<dev>/device links to ../../../0000:3b:00.0 (the PCI function).
  std::error_code ec;
  const fs::path target = fs::read_symlink(Under(root, "/sys/class/infiniband") / ib_device / "device", ec);
  if (ec) return "";
  return target.filename().string();
}

int ReadRdmaDeviceNumaNode(const std::string& root, const std::string& ib_device) {
  return ParseNumaNode(ReadFirstLine(Under(root, "/sys/class/infiniband") / ib_device / "device" / "numa_node"));
}

std::string FormatGid(const uint8_t (&raw)[16]) {
  if (std::all_of(std::begin(raw), std::end(raw), [](uint8_t b) { return b == 0; })) return "";
  char text[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(AF_INET6, raw, text, sizeof(text)) == nullptr) return "";
  return text;
}

std::string FormatGpuUuid(const uint8_t (&b)[16]) {
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                         b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

}  // namespace epfabric::daemon::topology
