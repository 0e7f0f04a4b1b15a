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

__device__ __forceinline__ void st_relaxed_sys_global(int64_t* ptr, int64_t v) {
  asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ int32_t atomic_add_release_sys_global(int32_t* ptr, int32_t v) {
  int32_t old;
  asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void red_add_release_sys_global(int32_t* ptr, int32_t v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// 16-byte volatile load: data a peer may still be writing, read without caching (no ordering implied).
__device__ __forceinline__ int4 ld_volatile_global(const int4* ptr) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
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

// 16-byte load cached in L2 only: for data that another GPU wrote into this GPU's memory during the kernel (L1 is
// not coherent with NVLink writes, and the read-only path must not be used for data written during a kernel).
__device__ __forceinline__ int4 ld_cg_global(const int4* ptr) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

__device__ __forceinline__ int32_t ld_cg_global(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

__device__ __forceinline__ int64_t ld_cg_global(const int64_t* ptr) {
  int64_t v;
  asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(ptr));
  return v;
}

// --- mbarrier and 1-D bulk copies (TMA) --------------------------------------------------------------------------
// A bulk copy moves a contiguous, 16-byte aligned run of global memory into shared memory without registers; its
// completion is counted on an mbarrier in transaction bytes.

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes mbarrier initialisation visible to the async proxy (bulk copies that complete on it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One poll of the phase with parity `parity`; true once it completed.
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
}

__device__ __forceinline__ void bulk_copy_global_to_shared(void* dst_smem, const void* src_global, uint32_t bytes,
                                                           uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst_smem)),
               "l"(src_global), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from shared memory into global memory, which
// may be a peer GPU's memory mapped into this process: the copy engine of the SM (TMA) moves it without registers.
// Completion is tracked per thread in bulk groups (commit_bulk_group / wait_bulk_group*).
__device__ __forceinline__ void bulk_copy_shared_to_global(void* dst_global, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst_global),
               "r"(smem_addr(src_smem)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void commit_bulk_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's bulk groups still read their shared-memory source (the buffers of
// the others may be reused; their writes may still be in flight).
template <int kPending>
__device__ __forceinline__ void wait_bulk_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's bulk groups are incomplete (their writes performed).
template <int kPending>
__device__ __forceinline__ void wait_bulk_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// Orders earlier generic-proxy accesses before later async-proxy (bulk copy) accesses of shared / global memory.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Barrier among `num_threads` threads (a multiple of 32) of the block that use the same `id` (ids 1.. are free; 0 is
// __syncthreads). Orders their memory accesses like __syncthreads does.
__device__ __forceinline__ void named_barrier(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace epfabric::kernels::ptx

namespace epfabric::kernels::ptx {

// Release at GPU scope: orders this thread's earlier writes (and, through a preceding warp/CTA barrier, those of the
// threads it synchronised with) before the addition, for a consumer on the same GPU that acquires the counter.
__device__ __forceinline__ void red_add_release_gpu_global(int32_t* ptr, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

}  // namespace epfabric::kernels::ptx
