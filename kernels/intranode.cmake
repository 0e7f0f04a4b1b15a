# Normal-mode intranode kernels (layout, notify, dispatch, combine) and their host side. One .cu per kernel keeps
# each translation unit quick to compile; the host reference is plain C++ (also used by tests and the host backend).
target_sources(epfabric_kernels PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/cuda/layout.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_notify.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_dispatch.cu
  ${CMAKE_CURRENT_LIST_DIR}/cuda/intranode_combine.cu
  ${CMAKE_CURRENT_LIST_DIR}/host/intranode_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/intranode_checks.cc
  ${CMAKE_CURRENT_LIST_DIR}/host/intranode_reference.cc)
