# Sourced by the vendor scripts: the pin, the cache location and the build key.
# shellcheck shell=bash
set -euo pipefail

VENDOR_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=/dev/null
. "$VENDOR_DIR/llama.cpp.pin"

# Everything expensive lives outside the checkout so that a fresh clone (CI) reuses it.
CACHE_DIR=${LLAMA_TRIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-trio}
SRC_DIR="$VENDOR_DIR/llama.cpp"
PYTHON=${PYTHON:-python3}

# Flags every build gets; CMAKE_ARGS from the environment are added (e.g. -DGGML_CUDA=ON).
# GGML_NATIVE=ON tunes for this CPU, so the CPU's flags are part of the key below.
BASE_CMAKE_ARGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=ON
  -DGGML_NATIVE=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_ALL_WARNINGS=OFF
  # llama.cpp's RPC backend (--rpc) and its ggml-rpc-server; plain TCP only (no RDMA library).
  -DGGML_RPC=ON
  -DGGML_RPC_RDMA=OFF
)

build_key() {
  {
    echo "$SHA256"
    printf '%s\n' "${BASE_CMAKE_ARGS[@]}" "${CMAKE_ARGS:-}"
    uname -m
    cc --version 2>/dev/null | head -n 1
    grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null || true
  } | sha256sum | cut -c 1-16
}

BUILD_ROOT="$CACHE_DIR/llama.cpp-$VERSION-$(build_key)"
BUILD_DIR="$BUILD_ROOT/build"
INSTALL_DIR="$BUILD_ROOT/install"
