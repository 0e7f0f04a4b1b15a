// libepfabric_client.so (client/CMakeLists.txt): the library is the static client, Buffer, protobuf and kernels
// libraries linked whole. This file adds one C entry point that a loader (ctypes, dlsym) can check first.
extern "C" const char* epfabric_client_version() { return EPF_VERSION; }
