#!/usr/bin/env bash
# scripts/gpu/deps.sh — the build dependencies that the GPU machines' image lacks (it has the CUDA toolkit, CMake,
# ninja, g++ and PyTorch, but no GTest, nlohmann_json, CLI11, PCRE2, OpenBLAS or cpp-httplib), as Debian 12 packages
# by name.
#
#   bash scripts/gpu/deps.sh download   here (Debian 12, reaches Debian's registry): apt-get download of PACKAGES
#                                       into build/gpu-debs (git-ignored, about 19 MB; carry it with the device
#                                       call: carry ["build/gpu-debs"])
#   bash scripts/gpu/deps.sh unpack     there: dpkg -x of each .deb into build/gpu-sysroot, then writes and prints
#                                       build/gpu-sysroot/deps.env, which scripts/gpu/lib.sh sources:
#                                         TESSERA_DEPS_CMAKE_ARGS  -DCMAKE_PREFIX_PATH=<sysroot>/usr (GTest,
#                                           nlohmann_json and CLI11 by their CMake configs, PCRE2, OpenBLAS and
#                                           cpp-httplib by find_path / find_library) and
#                                           -DTESSERA_GTEST_SOURCE_DIR (googletest's sources: tests/CMakeLists.txt
#                                           builds GTest from them if Debian's libgtest.a, built by gcc 12, does not
#                                           link with the image's compiler)
#                                         LD_LIBRARY_PATH  a folder with the shared libraries the image lacks
#                                           (OpenBLAS and its libgfortran / libquadmath, cpp-httplib and its
#                                           Brotli): the linker resolves libopenblas's and libcpp-httplib's own
#                                           dependencies there, and the programs load them
#   e.g. cmake --preset cuda $TESSERA_DEPS_CMAKE_ARGS (after `. build/gpu-sysroot/deps.env`)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEBS=$ROOT/build/gpu-debs
SYSROOT=$ROOT/build/gpu-sysroot
# The closure of what the build needs beyond the image (checked with dpkg -c / apt-cache depends on Debian 12):
# libgtest-dev (headers, libgtest*.a, CMake config; gmock is not used), googletest (its sources), the header-only
# nlohmann-json3-dev and libcli11-dev (with CMake configs), libpcre2-dev (header, libpcre2-8.so link) and
# libpcre2-8-0 (the library), libopenblas-pthread-dev (cblas.h, libopenblas.so link; libopenblas-dev itself is
# an empty package that only depends on a flavour) and libopenblas0-pthread (the library), whose libgfortran5 and
# libquadmath0 are the remaining dependencies (libc6, libgcc-s1 and gcc-12-base are on any image).
# `tessera serve` needs cpp-httplib: libcpp-httplib-dev (httplib.h, the libcpp-httplib.so link) and
# libcpp-httplib0.11 (the library: Debian builds it as a compiled library, the header holds declarations only).
# src/CMakeLists.txt compiles the header with CPPHTTPLIB_OPENSSL/ZLIB/BROTLI_SUPPORT (so that its classes match the
# library's), and then httplib.h includes <openssl/ssl.h>, <zlib.h> and <brotli/decode.h>: hence libssl-dev,
# zlib1g-dev and libbrotli-dev for their headers (the image has no -dev packages of its own that we know of).
# The library needs libssl.so.3, libcrypto.so.3, libz.so.1 and libbrotli{dec,enc,common}.so.1 to link and load:
# libbrotli1 is carried; libssl3 (on any image with curl, ca-certificates or Python's ssl module) and zlib1g
# (Essential in Debian and Ubuntu) are not -- `unpack` says so if the image lacks them (then add them here).
# `tessera plan --method moa` needs CBC (src/CMakeLists.txt finds Cbc_C_Interface.h and libCbcSolver): the coinor
# -dev packages for the headers and links, their libraries (Cbc, Cgl, Clp, Osi, CoinUtils) and the reference
# LAPACK / BLAS CoinUtils loads (Debian keeps them in lapack/ and blas/ behind alternatives: linked by name here).
PACKAGES=(libgtest-dev googletest nlohmann-json3-dev libcli11-dev libpcre2-dev libpcre2-8-0
  libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
  libcpp-httplib-dev libcpp-httplib0.11 libbrotli1 libbrotli-dev libssl-dev zlib1g-dev
  coinor-libcbc-dev coinor-libcbc3 coinor-libcgl-dev coinor-libcgl1 coinor-libclp-dev coinor-libclp1
  coinor-libcoinutils-dev coinor-libcoinutils3v5 coinor-libosi-dev coinor-libosi1v5 liblapack3 libblas3)

download() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  rm -rf "$DEBS"
  mkdir -p "$DEBS"
  # In /tmp first: apt's _apt user cannot write into a folder under a root-only home.
  local tmp
  tmp=$(mktemp -d)
  chmod 777 "$tmp"
  (cd "$tmp" && apt-get download "${PACKAGES[@]}")
  mv "$tmp"/*.deb "$DEBS/"
  rmdir "$tmp"
  for deb in "$DEBS"/*.deb; do
    printf '%-28s %-22s depends: %s\n' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)" \
      "$(dpkg-deb -f "$deb" Depends)"
  done | tee "$DEBS/MANIFEST"
  du -sh "$DEBS"
  echo "carry build/gpu-debs with the device call; there: bash scripts/gpu/deps.sh unpack"
}

unpack() {
  [ -d "$DEBS" ] || { echo "deps.sh: no $DEBS (run 'bash scripts/gpu/deps.sh download' on a Debian machine and carry it)"; exit 1; }
  rm -rf "$SYSROOT"
  mkdir -p "$SYSROOT/ld-path"
  for deb in "$DEBS"/*.deb; do
    if command -v dpkg-deb > /dev/null; then
      dpkg-deb -x "$deb" "$SYSROOT"
    else  # a .deb is an ar archive; Debian 12's hold data.tar.xz
      ar p "$deb" data.tar.xz | tar -xJ -C "$SYSROOT"
    fi
  done
  local usr=$SYSROOT/usr lib=$SYSROOT/usr/lib/x86_64-linux-gnu
  # The shared libraries to load from here: OpenBLAS always, libgfortran / libquadmath only when the image has
  # none (a newer system copy stays in use).
  local have
  have=$(ldconfig -p 2> /dev/null || true)
  ln -s "$lib/openblas-pthread/libopenblas.so.0" "$SYSROOT/ld-path/"
  ln -s "$lib/libcpp-httplib.so.0.11" "$SYSROOT/ld-path/"
  for so in libgfortran.so.5 libquadmath.so.0 libbrotlicommon.so.1 libbrotlidec.so.1 libbrotlienc.so.1; do
    grep -q "$so " <<< "$have" || ln -s "$lib/$so" "$SYSROOT/ld-path/"
  done
  for so in "$lib"/libCbc*.so.* "$lib"/libCgl.so.* "$lib"/libClp*.so.* "$lib"/libOsi*.so.* "$lib"/libCoinUtils.so.*; do
    [ -e "$so" ] && ln -sf "$so" "$SYSROOT/ld-path/"
  done
  for so in liblapack.so.3 libblas.so.3; do
    grep -q "$so " <<< "$have" || ln -sf "$(ls "$lib"/*/"$so" | head -1)" "$SYSROOT/ld-path/"
  done
  for so in libssl.so.3 libcrypto.so.3 libz.so.1; do
    grep -q "$so " <<< "$have" ||
      echo "deps.sh: the image has no $so: libcpp-httplib will not link (tessera serve); add its package to PACKAGES"
  done
  # OpenSSL's configuration.h / opensslconf.h live in the multiarch folder (usr/include/x86_64-linux-gnu), which
  # the compiler searches under /usr but not under the sysroot: linked next to the other OpenSSL headers, where
  # httplib.h's include folder (found by find_path) reaches them.
  local inc=$usr/include
  for h in "$inc"/x86_64-linux-gnu/openssl/*.h; do
    [ -e "$inc/openssl/$(basename "$h")" ] || ln -s "../x86_64-linux-gnu/openssl/$(basename "$h")" "$inc/openssl/"
  done
  cat > "$SYSROOT/deps.env" <<EOF
# written by scripts/gpu/deps.sh unpack: source it, then cmake --preset cuda \$TESSERA_DEPS_CMAKE_ARGS
export TESSERA_DEPS_CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$usr -DTESSERA_GTEST_SOURCE_DIR=$usr/src/googletest"
export LD_LIBRARY_PATH="$SYSROOT/ld-path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
  du -sh "$SYSROOT"
  ls -l "$SYSROOT/ld-path"
  cat "$SYSROOT/deps.env"
}

case "${1:-}" in
  download) download ;;
  unpack) unpack ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
