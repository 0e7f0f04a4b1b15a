/* The C ABI from C (not C++): epfabric.h compiles as C99 and libepfabric_client.so links and answers, with clear
 * errors for bad arguments and an unreachable daemon. The data path through this ABI is tested from Python
 * (tests/python), which calls every entry point. */
#include <stdio.h>
#include <string.h>

#include "epfabric/epfabric.h"

static int failures = 0;
#define EXPECT(cond)                                             \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                \
    }                                                            \
  } while (0)

int main(void) {
  EXPECT(epf_abi_version() == EPF_ABI_VERSION);
  EXPECT(strlen(epf_version()) > 0);
  EXPECT(epf_abi_minor_version() == EPF_ABI_MINOR_VERSION);

  /* The additions to ABI 1 check their arguments as the first calls do. */
  epf_dispatch_options options = {.struct_size = sizeof(options), .num_worst_tokens = 64};
  epf_dispatch_result result;
  memset(&result, 0, sizeof(result));
  EXPECT(epf_dispatch_ex(NULL, NULL, &options, NULL, &result) == EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "null") != NULL);
  epf_tensor prefix;
  EXPECT(epf_dispatch_handle_rank_prefix_matrix(NULL, &prefix) == EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "null") != NULL);
  epf_ll_options ll_options = {.struct_size = sizeof(ll_options)};
  epf_ll_dispatch_result ll_result;
  memset(&ll_result, 0, sizeof(ll_result));
  EXPECT(epf_low_latency_dispatch_ex(NULL, NULL, &ll_options, NULL, &ll_result) == EPF_INVALID_ARGUMENT);
  epf_ll_combine_result ll_combined;
  memset(&ll_combined, 0, sizeof(ll_combined));
  EXPECT(epf_low_latency_combine_ex(NULL, NULL, &ll_options, NULL, &ll_combined) == EPF_INVALID_ARGUMENT);
  epf_allocator allocator = {.struct_size = sizeof(allocator)};
  epf_buffer* buffer = NULL;
  EXPECT(epf_buffer_create_ex(NULL, NULL, &allocator, &buffer) == EPF_INVALID_ARGUMENT);
  EXPECT(buffer == NULL);
  epf_buffer_options buffer_options = {.struct_size = sizeof(buffer_options), .low_latency_issue = EPF_LL_ISSUE_DEVICE};
  EXPECT(epf_buffer_create_opts(NULL, NULL, &allocator, &buffer_options, &buffer) == EPF_INVALID_ARGUMENT);
  EXPECT(buffer == NULL);

  epf_client* client = NULL;
  EXPECT(epf_client_connect(NULL, "c", 1.0, &client) == EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "null") != NULL);
  epf_status status = epf_client_connect("/nonexistent/epfabric.sock", "c", 0.2, &client);
  EXPECT(status == EPF_NOT_FOUND || status == EPF_UNAVAILABLE);
  EXPECT(strstr(epf_last_error(), "/nonexistent/epfabric.sock") != NULL);
  EXPECT(client == NULL);
  char host[64];
  EXPECT(epf_client_host_id(NULL, host, sizeof(host)) == EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "null") != NULL);
  epf_group_options group_options = {
      .struct_size = sizeof(group_options), .num_normal_bytes = 4096, .num_normal_rdma_bytes = 4096};
  const int32_t ranks[2] = {0, 1};
  char token[65];
  EXPECT(epf_create_group_opts(NULL, "g", ranks, 2, 1 << 20, 1 << 20, 1, &group_options, token, sizeof(token)) ==
         EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "null") != NULL);

  epf_buffer_config config = {
      .max_tokens_per_rank = 128, .hidden = 7168, .max_topk = 8, .num_experts = 288, .low_latency = 1};
  uint64_t nvl = 0, rdma = 0;
  EXPECT(epf_required_group_bytes(&config, 1, 8, &nvl, &rdma) == EPF_OK);
  EXPECT(nvl > 128ull * 7168 && rdma == 0);
  config.num_experts = 7; /* not a multiple of the ranks */
  EXPECT(epf_required_group_bytes(&config, 1, 8, &nvl, &rdma) == EPF_INVALID_ARGUMENT);
  EXPECT(strstr(epf_last_error(), "num_experts") != NULL);

  if (failures == 0) printf("c_abi_test: OK\n");
  return failures == 0 ? 0 : 1;
}
