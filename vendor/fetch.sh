#!/usr/bin/env bash
# Make vendor/llama.cpp/ hold the pinned llama.cpp tree: download the pinned sdist once into the
# cache (pip download, no dependencies, source only), check its sha256, unpack only the tree.
. "$(dirname "$0")/common.sh"

stamp="$SRC_DIR/.pin-sha256"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$SHA256" ]]; then
  exit 0
fi

sdist_dir="$CACHE_DIR/sdist"
sdist="$sdist_dir/${PACKAGE//-/_}-$VERSION.tar.gz"
mkdir -p "$sdist_dir"
if [[ ! -f "$sdist" ]] || ! echo "$SHA256  $sdist" | sha256sum --check --status; then
  echo "vendor: downloading $PACKAGE==$VERSION (source only, about a minute)" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "$PACKAGE==$VERSION"
  mv "$tmp"/*.tar.gz "$sdist"
fi
if ! echo "$SHA256  $sdist" | sha256sum --check --status; then
  echo "vendor: sha256 mismatch for $sdist; expected $SHA256" >&2
  rm -f "$sdist"
  exit 1
fi

echo "vendor: unpacking the llama.cpp tree into $SRC_DIR" >&2
rm -rf "$SRC_DIR"
mkdir -p "$SRC_DIR"
tar -xzf "$sdist" -C "$SRC_DIR" --strip-components=3 "${PACKAGE//-/_}-$VERSION/$TREE"
echo "$SHA256" > "$stamp"
