# install_test (label unit): `cmake --install` of the build tree into a fresh prefix, then every file a user of the
# installation needs must be there. Run as: cmake -DBUILD_DIR=... -DPREFIX=... -P install_test.cmake
foreach(var BUILD_DIR PREFIX BINDIR LIBDIR INCLUDEDIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_test: -D${var}= is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX} RESULT_VARIABLE rc
                OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_test: cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${rc})")
endif()
set(bin ${PREFIX}/${BINDIR})
set(lib ${PREFIX}/${LIBDIR})
set(inc ${PREFIX}/${INCLUDEDIR})
set(expected
    ${bin}/epfabricd ${bin}/epctl ${bin}/epfabric_worker ${bin}/epfabric_device_plugin
    ${lib}/libepfabric_client.a ${lib}/libepfabric_buffer.a ${lib}/libepfabric_kernels.a
    ${lib}/libepfabric_client.so
    ${lib}/python3/dist-packages/epfabric/__init__.py ${lib}/python3/dist-packages/epfabric/deep_ep.py
    ${inc}/epfabric/epfabric.h ${inc}/epfabric/client/client.h ${inc}/epfabric/client/buffer.h
    ${inc}/epfabric/kernels/common.h ${inc}/epfabric/kernels/intranode.h ${inc}/epfabric/kernels/low_latency.h
    ${inc}/epfabric/kernels/status_word.h
    ${inc}/epfabric/v1/common.pb.h ${inc}/epfabric/v1/control.pb.h)
set(missing "")
foreach(file IN LISTS expected)
  if(NOT EXISTS ${file})
    list(APPEND missing ${file})
  endif()
endforeach()
foreach(program epfabricd epctl epfabric_worker epfabric_device_plugin)
  if(EXISTS ${bin}/${program} AND NOT IS_DIRECTORY ${bin}/${program})
    file(READ ${bin}/${program} magic LIMIT 4 HEX)
    if(NOT magic STREQUAL "7f454c46")
      list(APPEND missing "${bin}/${program} (not an ELF file)")
    endif()
  endif()
endforeach()
if(missing)
  list(JOIN missing "\n  " missing)
  message(FATAL_ERROR "install_test: missing from ${PREFIX}:\n  ${missing}")
endif()
file(REMOVE_RECURSE ${PREFIX})
message(STATUS "install_test: OK (${PREFIX})")
