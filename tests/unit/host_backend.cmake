# Host backend: ranks as threads over malloc'ed regions, and ranks as processes over POSIX shared memory, checked
# element by element against the host references.
epf_add_test(NAME host_backend_test LABEL unit SOURCES host_backend_test.cc host_backend_throughput_test.cc LIBS epfabric_kernels Threads::Threads)
target_link_libraries(host_backend_test PRIVATE epfabric_kernels_reference)
epf_add_test(NAME host_backend_process_test LABEL unit SOURCES host_backend_process_test.cc
             LIBS epfabric_kernels Threads::Threads rt)
target_link_libraries(host_backend_process_test PRIVATE epfabric_kernels_reference)
# Untrusted shared memory (issue #13): bad peer data in the regions gives an error naming the peer, never a crash.
epf_add_test(NAME host_backend_untrusted_test LABEL unit SOURCES host_backend_untrusted_test.cc host_backend_garbage_test.cc
             LIBS epfabric_kernels Threads::Threads)
target_link_libraries(host_backend_untrusted_test PRIVATE epfabric_kernels_reference)
# Their scenarios generate and check much data in the tests' own code: optimised under a sanitizer too (the tests'
# code is -O0 there, tests/CMakeLists.txt), so without the precompiled header, which is built without optimisation.
if(EPF_SANITIZE)
  set_source_files_properties(host_backend_test.cc host_backend_throughput_test.cc host_backend_process_test.cc
                              PROPERTIES SKIP_PRECOMPILE_HEADERS ON COMPILE_OPTIONS -O1)
endif()
