# XGrammar's C++ core (https://github.com/mlc-ai/xgrammar, Apache-2.0): the grammar library behind structured output
# (response_format, tools; docs/server.md). Taken from its PyPI sdist, pinned by SHA-256, downloaded once into
# ~/.cache/tessera/downloads (shared by every build tree; a clean CI clone downloads it at configure time, an offline
# machine can put the file there by hand) and unpacked into the build tree. Only the C++ core is compiled (cpp/,
# cpp/support, cpp/converter_ext; not the tvm_ffi Python bindings), as the static library tessera_xgrammar with its
# own flags: C++17 as upstream builds it, no warnings (third-party code is not subject to our -Werror) and its
# headers included as SYSTEM headers. Upstream's CMakeLists is not used: it sets global flags (-Werror, -flto).
# Sets TESSERA_HAS_XGRAMMAR; TESSERA_XGRAMMAR=OFF (or a failed download) switches structured output off.
option(TESSERA_XGRAMMAR "Structured output (response_format, tools) through XGrammar's C++ core (downloaded)" ON)
set(TESSERA_HAS_XGRAMMAR OFF)
if(NOT TESSERA_XGRAMMAR)
  tessera_part_off("structured output" "TESSERA_XGRAMMAR=OFF")
  return()
endif()

set(_xg_version 0.2.9)
set(_xg_url "https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-${_xg_version}.tar.gz")
set(_xg_sha256 87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90)
# TESSERA_DOWNLOADS (environment): another folder that holds the file (a machine without network: the GPU scripts
# carry it in build/downloads).
if(DEFINED ENV{TESSERA_DOWNLOADS})
  set(_xg_cache "$ENV{TESSERA_DOWNLOADS}")
else()
  set(_xg_cache "$ENV{HOME}/.cache/tessera/downloads")
endif()
set(_xg_tarball "${_xg_cache}/xgrammar-${_xg_version}.tar.gz")
set(_xg_src "${CMAKE_BINARY_DIR}/_deps/xgrammar-${_xg_version}")

if(EXISTS "${_xg_tarball}")
  file(SHA256 "${_xg_tarball}" _xg_have)
  if(NOT _xg_have STREQUAL _xg_sha256)
    message(STATUS "tessera: ${_xg_tarball} has SHA-256 ${_xg_have}, not ${_xg_sha256}: downloading it again")
    file(REMOVE "${_xg_tarball}")
  endif()
endif()
if(NOT EXISTS "${_xg_tarball}")
  file(MAKE_DIRECTORY "${_xg_cache}")
  message(STATUS "tessera: downloading XGrammar ${_xg_version} (PyPI sdist, 2.8 MB) into ${_xg_cache}")
  # The hash is checked after the download: with EXPECTED_HASH, a failed download (no network) is a configure error.
  file(DOWNLOAD "${_xg_url}" "${_xg_tarball}.part" STATUS _xg_status TLS_VERIFY ON)
  list(GET _xg_status 0 _xg_code)
  if(_xg_code EQUAL 0)
    file(SHA256 "${_xg_tarball}.part" _xg_have)
    if(NOT _xg_have STREQUAL _xg_sha256)
      set(_xg_code 1)
      set(_xg_status "SHA-256 ${_xg_have}, not ${_xg_sha256}")
    endif()
  endif()
  if(NOT _xg_code EQUAL 0)
    file(REMOVE "${_xg_tarball}.part")
    tessera_part_off("structured output" "XGrammar ${_xg_version} could not be downloaded from ${_xg_url}: ${_xg_status}")
    return()
  endif()
  file(RENAME "${_xg_tarball}.part" "${_xg_tarball}")
endif()
if(NOT EXISTS "${_xg_src}/.tessera-unpacked")
  file(REMOVE_RECURSE "${_xg_src}")
  file(ARCHIVE_EXTRACT INPUT "${_xg_tarball}" DESTINATION "${CMAKE_BINARY_DIR}/_deps")
  file(TOUCH "${_xg_src}/.tessera-unpacked")
endif()

# The library depends only on the sources, the compiler and the build type: one built library is kept in
# ~/.cache/tessera/xgrammar-<version>-<key>/ and taken by every later build tree with the same key (CI builds the ci,
# asan, cuda-ci and wheel trees with the same g++: ~10 min at -j2 on a 2-core machine each, paid once), the
# first tree that builds it copies it there. Always position-independent (the Python module links it into a shared
# object), so that trees with and without the module share it. TESSERA_XGRAMMAR_REBUILD=ON ignores the cache.
option(TESSERA_XGRAMMAR_REBUILD "Build XGrammar in this tree even when ~/.cache/tessera holds a built one" OFF)
set(TESSERA_XGRAMMAR_LIBRARY "" CACHE FILEPATH "A libtessera_xgrammar.a built before from the same sources (empty: the cache's, or build)")
if(CMAKE_BUILD_TYPE)
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _xg_bt)
endif()
# Debug-info flags do not change the code (the asan preset adds -g1): they are not part of the key.
string(REGEX REPLACE "(^| )-g[0-9a-z]*" "" _xg_flags "${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${_xg_bt}}")
# _xg_recipe: raise it when the sources or flags below change, so that the trees build anew (not hashing this file's
# text: an edit of a comment would rebuild every tree's copy).
set(_xg_recipe 1)
string(SHA256 _xg_key "${_xg_version}|${_xg_sha256}|${CMAKE_CXX_COMPILER_ID}|${CMAKE_CXX_COMPILER_VERSION}|${CMAKE_CXX_COMPILER}|${_xg_flags}|${_xg_recipe}")
string(SUBSTRING "${_xg_key}" 0 16 _xg_key)
set(_xg_built_dir "$ENV{HOME}/.cache/tessera/xgrammar-${_xg_version}-${_xg_key}")
set(_xg_built "${_xg_built_dir}/libtessera_xgrammar.a")

if(TESSERA_XGRAMMAR_LIBRARY)
  add_library(tessera_xgrammar STATIC IMPORTED GLOBAL)
  set_target_properties(tessera_xgrammar PROPERTIES IMPORTED_LOCATION "${TESSERA_XGRAMMAR_LIBRARY}")
  set(_xg_how "TESSERA_XGRAMMAR_LIBRARY: ${TESSERA_XGRAMMAR_LIBRARY}")
elseif(EXISTS "${_xg_built}" AND NOT TESSERA_XGRAMMAR_REBUILD)
  add_library(tessera_xgrammar STATIC IMPORTED GLOBAL)
  set_target_properties(tessera_xgrammar PROPERTIES IMPORTED_LOCATION "${_xg_built}")
  set(_xg_how "built before: ${_xg_built}")
else()
  file(GLOB _xg_sources "${_xg_src}/cpp/*.cc" "${_xg_src}/cpp/support/*.cc" "${_xg_src}/cpp/converter_ext/*.cc")
  add_library(tessera_xgrammar STATIC ${_xg_sources})
  set_target_properties(tessera_xgrammar PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
                                                    POSITION_INDEPENDENT_CODE ON)
  target_compile_options(tessera_xgrammar PRIVATE -w)
  target_include_directories(tessera_xgrammar PRIVATE "${_xg_src}/include" "${_xg_src}/3rdparty/picojson"
                             "${_xg_src}/3rdparty/dlpack/include")
  target_compile_definitions(tessera_xgrammar PRIVATE XGRAMMAR_ENABLE_CPPTRACE=0)
  add_custom_command(TARGET tessera_xgrammar POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E make_directory "${_xg_built_dir}"
    COMMAND ${CMAKE_COMMAND} -E copy "$<TARGET_FILE:tessera_xgrammar>" "${_xg_built}.part"
    COMMAND ${CMAKE_COMMAND} -E rename "${_xg_built}.part" "${_xg_built}"
    VERBATIM)
  set(_xg_how "built in this tree, then kept in ${_xg_built_dir}")
endif()
target_compile_definitions(tessera_xgrammar INTERFACE XGRAMMAR_ENABLE_CPPTRACE=0)
target_include_directories(tessera_xgrammar SYSTEM INTERFACE "${_xg_src}/include" "${_xg_src}/3rdparty/picojson"
                           "${_xg_src}/3rdparty/dlpack/include")
target_link_libraries(tessera_xgrammar INTERFACE Threads::Threads)
set(TESSERA_HAS_XGRAMMAR ON)
message(STATUS "tessera: XGrammar ${_xg_version} (${_xg_how})")
