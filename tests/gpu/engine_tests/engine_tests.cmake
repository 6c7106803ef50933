# The GPU engine's tests (ctest label "gpu"): GPU logits against the CPU engine on every tiny fixture model,
# the sparse executor path against the simple kernel, and the real small models when present.
#
# Included (not add_subdirectory'd) by a deferred call from src/runtime_cuda/CMakeLists.txt at the end of the
# top-level directory, after enable_testing() and tests/, so that ctest sees the tests from the build root.
# Discovery happens at test time (PRE_TEST), so building needs no GPU.
find_package(GTest REQUIRED)
include(GoogleTest)
file(GLOB TESSERA_ENGINE_GPU_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*_test.cpp)
foreach(src ${TESSERA_ENGINE_GPU_TEST_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  add_executable(${name} ${src})
  target_link_libraries(${name} PRIVATE tessera_runtime_cuda GTest::gtest_main tessera_warnings)
  target_compile_definitions(${name} PRIVATE TESSERA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests/gpu)
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 60 PROPERTIES LABELS gpu)
endforeach()
