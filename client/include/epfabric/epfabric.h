/* epfabric's C ABI (libepfabric_client.so): the client and the Buffer for any language and compiler. Python's
 * `epfabric` package loads it with ctypes (python/epfabric/_lib.py).
 *
 * Conventions:
 *  - Every call that can fail returns an epf_status: 0 is OK, other values are absl/gRPC status codes
 *    (EPF_INVALID_ARGUMENT = 3, ...). epf_last_error() gives the message of the calling thread's last failure.
 *  - Objects are opaque pointers, created by one call and released by its _destroy. A Buffer must be destroyed before
 *    its lease, a lease before its client. Handles (epf_dispatch_handle, epf_ll_handle), hooks (epf_hook) and
 *    layouts (epf_layout_release) own what they free: they may be destroyed before or after their Buffer, lease and
 *    client, in any order. Their memory goes back through the Buffer's allocator, so the allocator's functions and
 *    ctx must stay valid until the last of them is destroyed (with the library's own allocator on cuda: the stream
 *    of the call that made them must still exist, its memory is freed in that stream's order). A handle is used
 *    (combine, cached dispatch) only with the Buffer that made it; a hook that runs after its Buffer was destroyed
 *    fails with EPF_FAILED_PRECONDITION.
 *  - Tensors are contiguous row-major: a data pointer, a dtype and a shape. Outputs are allocated through the
 *    allocator given to epf_buffer_create (a framework hands out its own memory, no copies); the output descriptors
 *    returned point into that memory. The allocator's free is called when the library no longer needs a block (the
 *    caller may keep using what it still references).
 *  - Streams are cudaStream_t passed as void* (NULL: the legacy default stream); ignored on the host backend.
 */
#ifndef EPFABRIC_EPFABRIC_H_
#define EPFABRIC_EPFABRIC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPF_ABI_VERSION 1
/* Additions to ABI 1 (new calls and option structs; no field of an existing struct ever changes):
 *   1: epf_dispatch_ex with epf_dispatch_options (num_worst_tokens);
 *   2: epf_low_latency_dispatch_ex / epf_low_latency_combine_ex with epf_ll_options (wait-cost statistics);
 *   3: epf_buffer_create_ex with epf_allocator (typed output allocation);
 *   4: epf_create_group_ex and epf_lease_num_normal_bytes (low-latency groups that also serve normal mode);
 *   5: epf_client_host_id (how many hosts a group over some daemons spans);
 *   6: epf_create_group_opts with epf_group_options and epf_lease_num_normal_rdma_bytes (groups across hosts that
 *      serve both modes; the transport's rings);
 *   7: epf_buffer_create_opts with epf_buffer_options (who issues low latency's puts across hosts).
 *   8: epf_buffer_options.enable_shrink (masking lost ranks is opt-in);
 *   9: epf_dispatch_handle_rank_prefix_matrix (DeepEP's rank_prefix_matrix of a dispatch within one host);
 *  10: epf_lease_group_bytes (the region sizes the group was created with, the same on every rank). */
#define EPF_ABI_MINOR_VERSION 10

typedef int32_t epf_status;
enum {
  EPF_OK = 0,
  EPF_CANCELLED = 1,
  EPF_UNKNOWN = 2,
  EPF_INVALID_ARGUMENT = 3,
  EPF_DEADLINE_EXCEEDED = 4,
  EPF_NOT_FOUND = 5,
  EPF_ALREADY_EXISTS = 6,
  EPF_PERMISSION_DENIED = 7,
  EPF_RESOURCE_EXHAUSTED = 8,
  EPF_FAILED_PRECONDITION = 9,
  EPF_ABORTED = 10,
  EPF_OUT_OF_RANGE = 11,
  EPF_UNIMPLEMENTED = 12,
  EPF_INTERNAL = 13,
  EPF_UNAVAILABLE = 14,
  EPF_DATA_LOSS = 15
};

/* Element types (the same numbers as epfabric::kernels::DType). */
enum { EPF_BF16 = 0, EPF_FP8_E4M3 = 1, EPF_FLOAT32 = 2, EPF_INT32 = 3, EPF_INT64 = 4, EPF_BOOL = 5 };
/* Backends (epfabric.v1.Backend). */
enum { EPF_BACKEND_CUDA = 1, EPF_BACKEND_HOST = 2 };

#define EPF_MAX_DIMS 4
typedef struct {
  void* data;    /* NULL with ndim == 0: not given */
  int32_t dtype; /* EPF_BF16 ... */
  int32_t ndim;  /* 0..EPF_MAX_DIMS */
  int64_t shape[EPF_MAX_DIMS];
} epf_tensor;

typedef struct epf_client epf_client;
typedef struct epf_lease epf_lease;
typedef struct epf_buffer epf_buffer;
typedef struct epf_dispatch_handle epf_dispatch_handle;
typedef struct epf_ll_handle epf_ll_handle;
typedef struct epf_hook epf_hook;
typedef struct epf_layout_keep epf_layout_keep;

/* Allocates `bytes` usable on `stream` (device memory on cuda, host memory on the host backend); NULL on failure. */
typedef void* (*epf_alloc_fn)(void* ctx, size_t bytes, void* stream);
typedef void (*epf_free_fn)(void* ctx, void* ptr, void* stream);

const char* epf_version(void);
int epf_abi_version(void);
/* The additions to ABI 1 this library has (EPF_ABI_MINOR_VERSION when it was built). */
int epf_abi_minor_version(void);
/* The message of this thread's last failed call ("" when none). Valid until the thread's next call. */
const char* epf_last_error(void);

/* ---- control ---- */
epf_status epf_client_connect(const char* socket_path, const char* client_name, double timeout_s, epf_client** out);
void epf_client_destroy(epf_client* client);
/* The daemon's fabric rank, fabric size, backend (EPF_BACKEND_*) and CUDA device (-1 on the host backend). */
epf_status epf_client_daemon_info(epf_client* client, int32_t* fabric_rank, int32_t* world_size, int32_t* backend,
                                  int32_t* device);
/* The daemon's host id (--host_id, else /etc/machine-id, else the boot id), NUL-terminated into `out`; daemons with
 * equal host ids share a host. EPF_INVALID_ARGUMENT when `capacity` is too small (the message says how much). */
epf_status epf_client_host_id(epf_client* client, char* out, size_t capacity);
/* Creates a group over `ranks` (fabric ranks, group rank i = ranks[i]); writes the token (NUL-terminated) into
 * token_out (at least 65 bytes: a smaller token_capacity is EPF_INVALID_ARGUMENT and creates nothing). */
epf_status epf_create_group(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                            uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency, char* token_out,
                            size_t token_capacity);
/* As epf_create_group; num_normal_bytes > 0 (with low_latency, num_rdma_bytes = 0): the group also serves normal mode,
 * whose Buffers use the first num_normal_bytes (a multiple of 4096) of every NVL region; low-latency Buffers the rest.
 * A group with an RDMA region (across hosts) splits that too: epf_create_group_opts. */
epf_status epf_create_group_ex(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                               uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency,
                               uint64_t num_normal_bytes, char* token_out, size_t token_capacity);
/* CreateGroup's other fields (see epf_dispatch_options for struct_size; a field past it, or 0, takes the default). */
typedef struct {
  uint32_t struct_size;
  /* A low-latency group that also serves normal mode: the bytes at the start of every NVL region for normal mode
   * (a multiple of 4096); across hosts also those of every RDMA region (num_normal_rdma_bytes, needed when
   * num_rdma_bytes > 0). Low-latency Buffers use the rest of each. */
  uint64_t num_normal_bytes;
  uint64_t num_normal_rdma_bytes;
  /* Groups across hosts: transport command rings per rank (1..32) and slots per ring (a power of two). */
  uint32_t transport_channels;
  uint32_t ring_slots;
} epf_group_options;
epf_status epf_create_group_opts(epf_client* client, const char* name, const int32_t* ranks, int num_ranks,
                                 uint64_t num_nvl_bytes, uint64_t num_rdma_bytes, int low_latency,
                                 const epf_group_options* options, char* token_out, size_t token_capacity);
epf_status epf_delete_group(epf_client* client, const char* name, const char* token);
/* accessing_device: the CUDA device whose kernels use the regions (-1: the current one). */
epf_status epf_attach(epf_client* client, const char* group, int rank, const char* token, int accessing_device,
                      epf_lease** out);
epf_status epf_lease_detach(epf_lease* lease);
void epf_lease_destroy(epf_lease* lease);
int epf_lease_rank(const epf_lease* lease);
int epf_lease_world_size(const epf_lease* lease);
int epf_lease_backend(const epf_lease* lease);
int epf_lease_low_latency(const epf_lease* lease);
/* A low-latency group that also serves normal mode: the bytes of each NVL region for normal mode; 0 otherwise. */
uint64_t epf_lease_num_normal_bytes(const epf_lease* lease);
/* The same for each RDMA region (a group across hosts that serves both modes); 0 otherwise. */
uint64_t epf_lease_num_normal_rdma_bytes(const epf_lease* lease);
/* The group's num_nvl_bytes and num_rdma_bytes as CreateGroup was given them: the same on every rank and backend.
 * A region as mapped (epf_lease_region) may be larger (cuda rounds it up to its allocation granularity). */
epf_status epf_lease_group_bytes(const epf_lease* lease, uint64_t* nvl_bytes, uint64_t* rdma_bytes);
/* Ranks on this host (the lease's NVLink peers), this rank included. */
int epf_lease_num_nvl_ranks(const epf_lease* lease);
/* OK while the group is usable; UNAVAILABLE when degraded. */
epf_status epf_lease_healthy(const epf_lease* lease);
/* This rank's region as mapped here (rdma != 0: its RDMA region): DeepEP's get_local_buffer_tensor. Writing into it
 * while an operation of the group is in flight corrupts that operation, as in DeepEP. */
epf_status epf_lease_region(const epf_lease* lease, int rdma, void** data, uint64_t* bytes);

/* ---- buffer ---- */
typedef struct {
  int32_t max_tokens_per_rank;
  int32_t hidden;
  int32_t max_topk;
  int32_t num_experts;
  int32_t num_sms; /* normal mode: SMs (= channels); 0: 20 */
  int32_t low_latency;
  double timeout_s;        /* 0: 5 s */
  int32_t low_latency_sms; /* low latency: blocks per launch, 0: one per SM */
} epf_buffer_config;

/* CreateGroup's num_nvl_bytes / num_rdma_bytes for `config` on num_hosts x ranks_per_host ranks. */
epf_status epf_required_group_bytes(const epf_buffer_config* config, int num_hosts, int ranks_per_host,
                                    uint64_t* nvl_bytes, uint64_t* rdma_bytes);
epf_status epf_buffer_create(epf_lease* lease, const epf_buffer_config* config, epf_alloc_fn alloc, epf_free_fn free_fn,
                             void* alloc_ctx, epf_buffer** out);

/* The memory of one output tensor: `dtype` (EPF_*), `ndim` dims of `shape`, `bytes` its size (0 when it has no
 * elements: return a non-null, 16-byte aligned pointer all the same). A framework returns its own tensor of that
 * type and shape, so that every output is one allocation it can hand out as is. NULL on failure. */
typedef void* (*epf_alloc_tensor_fn)(void* ctx, int32_t dtype, int32_t ndim, const int64_t* shape, size_t bytes,
                                     void* stream);
typedef struct {
  uint32_t struct_size;             /* sizeof(epf_allocator) as the caller compiled it */
  epf_alloc_fn alloc;               /* blocks of bytes; used for outputs when alloc_tensor is NULL */
  epf_free_fn free_fn;              /* every block or tensor the library got from this allocator */
  void* ctx;                        /* passed to the three functions */
  epf_alloc_tensor_fn alloc_tensor; /* optional: one call per output tensor, with its type and shape */
} epf_allocator;

/* As epf_buffer_create; allocator NULL, or with neither alloc nor alloc_tensor: the library's own allocator. */
epf_status epf_buffer_create_ex(epf_lease* lease, const epf_buffer_config* config, const epf_allocator* allocator,
                                epf_buffer** out);
/* The Buffer's other settings (see epf_dispatch_options for struct_size; a field past it, or 0, takes the default). */
enum {
  EPF_LL_ISSUE_AUTO = 0,   /* the device on the verbs wire, the calling thread on the socket wire (or the
                            * environment's EPF_LOW_LATENCY_ISSUE) */
  EPF_LL_ISSUE_RELAY = 1,  /* the calling thread relays between launches (not capturable into a CUDA graph) */
  EPF_LL_ISSUE_DEVICE = 2, /* kernels put and wait on the device (capturable); cuda groups only */
};
typedef struct {
  uint32_t struct_size;
  int32_t low_latency_issue; /* low latency across hosts on cuda: EPF_LL_ISSUE_* */
  int32_t enable_shrink;     /* low latency: nonzero masks lost or silent ranks and goes on (BufferConfig::
                              * enable_shrink, DeepEP's enable_shrink); 0: such a call fails naming the rank */
} epf_buffer_options;
/* As epf_buffer_create_ex, with options (NULL: the defaults). */
epf_status epf_buffer_create_opts(epf_lease* lease, const epf_buffer_config* config, const epf_allocator* allocator,
                                  const epf_buffer_options* options, epf_buffer** out);
void epf_buffer_destroy(epf_buffer* buffer);
int epf_buffer_rank(const epf_buffer* buffer);
int epf_buffer_num_ranks(const epf_buffer* buffer);
epf_status epf_buffer_check(epf_buffer* buffer, void* stream);
epf_status epf_buffer_reset(epf_buffer* buffer, void* stream);

/* ---- normal mode ---- */
typedef struct {
  epf_tensor num_tokens_per_rank;   /* int32 [num_ranks] */
  epf_tensor num_tokens_per_expert; /* int32 [num_experts] */
  epf_tensor is_token_in_rank;      /* bool [num_tokens, num_ranks] */
  epf_tensor num_invalid_topk;      /* int32 [1], written by the layout (cuda); may be left empty */
  /* Keeps num_invalid_topk's memory (not from the caller's allocator) alive; release with epf_layout_release. */
  epf_layout_keep* keep;
} epf_layout;
void epf_layout_release(epf_layout* layout);

epf_status epf_get_dispatch_layout(epf_buffer* buffer, const epf_tensor* topk_idx, void* stream, epf_layout* out);

typedef struct {
  epf_tensor x;                      /* bf16 or fp8_e4m3 [num_tokens, hidden] */
  epf_tensor x_scales;               /* fp8: float [num_tokens, hidden / 128] or int32 [num_tokens, hidden / 512] */
  epf_tensor topk_idx;               /* int64 [num_tokens, num_topk], optional */
  epf_tensor topk_weights;           /* float [num_tokens, num_topk], optional */
  const epf_layout* layout;          /* required unless cached */
  const epf_dispatch_handle* cached; /* cached dispatch: a handle from an earlier dispatch */
  int32_t expert_alignment;          /* 0 or 1: none */
} epf_dispatch_args;

typedef struct {
  epf_tensor recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights;
  int32_t num_recv_tokens;
  int32_t num_local_experts;
  int32_t* num_recv_tokens_per_expert; /* caller's array of num_local_experts_capacity entries, filled */
  int32_t num_local_experts_capacity;
  epf_dispatch_handle* handle; /* out: release with epf_dispatch_handle_destroy */
} epf_dispatch_result;

epf_status epf_dispatch(epf_buffer* buffer, const epf_dispatch_args* args, void* stream, epf_dispatch_result* out);

/* Options added after the args structs were fixed. struct_size = sizeof(the struct) as the caller compiled it: the
 * library reads only the fields that fit in it, so a caller built against an older header keeps working. A zeroed
 * field (or NULL options) is the default. */
typedef struct {
  uint32_t struct_size;
  /* > 0 (DeepEP's num_worst_tokens): no host wait for the received count, so the call is CUDA-graph capturable;
   * every output has exactly this many rows, rows past the received ones have top-k index -1 and weight 0, the
   * per-expert counts are empty (num_local_experts = 0) and num_recv_tokens is this. A rank that receives more rows
   * moves nothing: EPF_RESOURCE_EXHAUSTED (host backend: from this call; cuda: from epf_buffer_check), its peers
   * EPF_DEADLINE_EXCEEDED, then every rank resets. Across hosts too: the RDMA stage then runs on the device on cuda
   * (its errors from epf_buffer_check), so the call is capturable there as well (decision 88). */
  int32_t num_worst_tokens;
} epf_dispatch_options;

epf_status epf_dispatch_ex(epf_buffer* buffer, const epf_dispatch_args* args, const epf_dispatch_options* options,
                           void* stream, epf_dispatch_result* out);
void epf_dispatch_handle_destroy(epf_dispatch_handle* handle);
int epf_dispatch_handle_num_recv_tokens(const epf_dispatch_handle* handle);
int epf_dispatch_handle_num_tokens(const epf_dispatch_handle* handle);
/* DeepEP's rank_prefix_matrix of a dispatch within one host: int32 [num_ranks, num_ranks], [i][j] = tokens ranks 0..i
 * send to rank j, on the buffer's device, written by the dispatch in stream order (a cached dispatch's is its
 * handle's). A view of the handle's memory: valid while the handle lives. A dispatch across hosts has none (nor has
 * DeepEP's internode handle): *out is then the empty descriptor (data NULL, ndim 0) and the status EPF_OK. */
epf_status epf_dispatch_handle_rank_prefix_matrix(const epf_dispatch_handle* handle, epf_tensor* out);

typedef struct {
  epf_tensor x;            /* bf16 [num_recv_tokens, hidden] */
  epf_tensor topk_weights; /* float [num_recv_tokens, num_topk], optional */
  epf_tensor bias_0, bias_1;
  const epf_dispatch_handle* handle;
} epf_combine_args;

typedef struct {
  epf_tensor combined_x, combined_topk_weights;
} epf_combine_result;

epf_status epf_combine(epf_buffer* buffer, const epf_combine_args* args, void* stream, epf_combine_result* out);

/* ---- low-latency mode ---- */
typedef struct {
  epf_tensor x;                /* bf16 [num_tokens, hidden] */
  epf_tensor topk_idx;         /* int64 [num_tokens, num_topk] */
  epf_tensor cumulative_stats; /* int32 [num_local_experts], optional, added to */
  int32_t use_fp8, round_scale, use_ue8m0, return_recv_hook;
} epf_ll_dispatch_args;

typedef struct {
  epf_tensor packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range;
  epf_ll_handle* handle; /* out */
  epf_hook* hook;        /* out with return_recv_hook: run once with epf_hook_run, then epf_hook_destroy */
} epf_ll_dispatch_result;

epf_status epf_low_latency_dispatch(epf_buffer* buffer, const epf_ll_dispatch_args* args, void* stream,
                                    epf_ll_dispatch_result* out);
void epf_ll_handle_destroy(epf_ll_handle* handle);

typedef struct {
  epf_tensor x;            /* bf16 [L, R*M, hidden] (ignored with zero_copy) */
  epf_tensor topk_idx;     /* int64 [num_tokens, num_topk] */
  epf_tensor topk_weights; /* float [num_tokens, num_topk] */
  const epf_ll_handle* handle;
  int32_t zero_copy, return_recv_hook;
  epf_tensor out; /* bf16 [num_tokens, hidden]: written instead of a new tensor; optional */
} epf_ll_combine_args;

typedef struct {
  epf_tensor combined_x;
  epf_hook* hook;
} epf_ll_combine_result;

epf_status epf_low_latency_combine(epf_buffer* buffer, const epf_ll_combine_args* args, void* stream,
                                   epf_ll_combine_result* out);
/* Options of the low-latency calls (see epf_dispatch_options for struct_size). */
typedef struct {
  uint32_t struct_size;
  /* int64 [num_ranks], added to; optional (DeepEP's dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats):
   * per rank, the nanoseconds the receive phase waited for that rank's data, at least 1 per wait (dispatch: one
   * wait per local expert and source rank; combine: one per call). */
  epf_tensor wait_recv_cost_stats;
} epf_ll_options;

epf_status epf_low_latency_dispatch_ex(epf_buffer* buffer, const epf_ll_dispatch_args* args,
                                       const epf_ll_options* options, void* stream, epf_ll_dispatch_result* out);
epf_status epf_low_latency_combine_ex(epf_buffer* buffer, const epf_ll_combine_args* args,
                                      const epf_ll_options* options, void* stream, epf_ll_combine_result* out);
epf_status epf_hook_run(epf_hook* hook, void* stream);
void epf_hook_destroy(epf_hook* hook);
/* Low latency: the rank mask, int32 [num_ranks] (nonzero = masked), device memory on cuda; callers read and write
 * it in stream order (DeepEP's mask-buffer calls). */
epf_status epf_low_latency_rank_mask(epf_buffer* buffer, epf_tensor* out);
/* Where expert outputs go for a zero-copy low-latency combine: bf16 [L, R*M, hidden] inside the rank's region. */
epf_status epf_next_low_latency_combine_buffer(epf_buffer* buffer, epf_tensor* out);

#ifdef __cplusplus
}
#endif

#endif /* EPFABRIC_EPFABRIC_H_ */
