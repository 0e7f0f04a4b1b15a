// Reading the facts topology needs from the file system (sysfs, /etc/machine-id) under a configurable root, so
// that tests can feed a fake tree. Pure functions, no CUDA, no verbs.
#pragma once

#include <cstdint>
#include <string>

namespace epfabric::daemon::topology {

// --host_id if given, else <root>/etc/machine-id, else <root>/proc/sys/kernel/random/boot_id, else "".
std::string ReadHostId(const std::string& root, const std::string& override_id);

// NUMA node of a PCI device ("0000:18:00.0", any case) from sysfs; -1 when unknown (or when sysfs says -1).
int ReadPciNumaNode(const std::string& root, const std::string& pci_bus_id);

// The device's local CPUs in Linux list form ("0-15,32-47"), or "".
std::string ReadPciLocalCpuList(const std::string& root, const std::string& pci_bus_id);

// PCI address of an RDMA device ("mlx5_0" -> "0000:3b:00.0") from its sysfs link; "" when unknown.
std::string ReadRdmaDevicePciAddress(const std::string& root, const std::string& ib_device);

// NUMA node of an RDMA device; -1 when unknown.
int ReadRdmaDeviceNumaNode(const std::string& root, const std::string& ib_device);

// Lower-case, 4-digit-domain form of a PCI bus id: "00000000:18:00.0" and "0000:18:00.0" -> "0000:18:00.0".
std::string NormalizePciBusId(const std::string& pci_bus_id);

// A 16-byte GID in IPv6 notation ("fe80::1"); "" for an all-zero GID.
std::string FormatGid(const uint8_t (&raw)[16]);

// NVIDIA's textual UUID form: "GPU-" + 8-4-4-4-12 lower-case hex digits.
std::string FormatGpuUuid(const uint8_t (&bytes)[16]);

}  // namespace epfabric::daemon::topology
