#!/usr/bin/env bash
# Build and install llama.cpp's shared libraries (and, when named, extra targets such as
# llama-server) into the cache, keyed by pin and flags. A second run with nothing to do returns
# at once without touching the source.
#
#   vendor/build.sh                      libllama + ggml, installed under the printed prefix
#   vendor/build.sh llama-server ...     also these targets (binaries stay in the build dir)
#   vendor/build.sh --print-prefix       print the install prefix, build nothing
#   vendor/build.sh --print-bin-dir      print where built tools land, build nothing
#
# LLAMA_CPP_PREFIX, when set, names an existing llama.cpp install; then nothing is built.
. "$(dirname "$0")/common.sh"

case "${1:-}" in
  --print-prefix) echo "${LLAMA_CPP_PREFIX:-$INSTALL_DIR}"; exit 0 ;;
  --print-bin-dir) echo "$BUILD_DIR/bin"; exit 0 ;;
esac

extra_targets=("$@")
jobs=${JOBS:-$(nproc)}

if [[ -n "${LLAMA_CPP_PREFIX:-}" && ${#extra_targets[@]} -eq 0 ]]; then
  exit 0
fi

need_libs=1
[[ -f "$INSTALL_DIR/.complete" ]] && need_libs=0
need_targets=()
for t in "${extra_targets[@]}"; do
  [[ -x "$BUILD_DIR/bin/$t" ]] || need_targets+=("$t")
done
if [[ $need_libs -eq 0 && ${#need_targets[@]} -eq 0 ]]; then
  exit 0
fi

"$VENDOR_DIR/fetch.sh"
start=$SECONDS
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  # shellcheck disable=SC2086
  cmake -S "$SRC_DIR" -B "$BUILD_DIR" "${BASE_CMAKE_ARGS[@]}" ${CMAKE_ARGS:-} \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON >"$BUILD_ROOT.configure.log" 2>&1 \
    || { cat "$BUILD_ROOT.configure.log" >&2; exit 1; }
fi
if [[ $need_libs -eq 1 ]]; then
  echo "vendor: building libllama + ggml with $jobs jobs (first time: several minutes)" >&2
  cmake --build "$BUILD_DIR" --config Release -j "$jobs" --target llama
  # Our own small install: the public headers and the shared libraries. (cmake --install would
  # also want every tool target built.)
  rm -rf "$INSTALL_DIR"
  mkdir -p "$INSTALL_DIR/include" "$INSTALL_DIR/lib"
  cp "$SRC_DIR"/include/llama.h "$SRC_DIR"/ggml/include/*.h "$INSTALL_DIR/include/"
  cp -a "$BUILD_DIR"/bin/lib*.so* "$INSTALL_DIR/lib/"
  touch "$INSTALL_DIR/.complete"
fi
if [[ ${#need_targets[@]} -gt 0 ]]; then
  echo "vendor: building ${need_targets[*]} with $jobs jobs" >&2
  cmake --build "$BUILD_DIR" --config Release -j "$jobs" --target "${need_targets[@]}"
fi
echo "vendor: done in $((SECONDS - start)) s ($BUILD_ROOT)" >&2
