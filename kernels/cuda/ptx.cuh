// PTX wrappers named by memory ordering and scope, used by every kernel that synchronises with a peer GPU.
// "sys" scope is what NVLink peers and the host need; "gpu" scope is enough within one device.
#pragma once

#include <cstdint>

namespace epfabric::kernels::ptx {

__device__ __forceinline__ int32_t ld_acquire_sys_global(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int64_t ld_acquire_sys_global(const int64_t* ptr) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_volatile_global(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_acquire_gpu_global(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_global(int32_t* ptr, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys_global(int64_t* ptr, int64_t v) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_global(int32_t* ptr, int32_t v) {
  asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t atomic_add_release_sys_global(int32_t* ptr, int32_t v) {
  int32_t old;
  asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void red_add_release_sys_global(int32_t* ptr, int32_t v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// 16-byte loads/stores that bypass L1 on the read side; used for payload copies through NVLink.
__device__ __forceinline__ int4 ld_nc_global(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void st_na_global(int4* ptr, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

}  // namespace epfabric::kernels::ptx

namespace epfabric::kernels::ptx {

// Release at GPU scope: orders this thread's earlier writes (and, through a preceding warp/CTA barrier, those of the
// threads it synchronised with) before the addition, for a consumer on the same GPU that acquires the counter.
__device__ __forceinline__ void red_add_release_gpu_global(int32_t* ptr, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

}  // namespace epfabric::kernels::ptx
