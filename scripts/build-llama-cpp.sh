#!/usr/bin/env bash
# Build llama.cpp's command-line tools (CPU, Release) from the source vendored in the
# PyPI sdist llama-cpp-python==0.3.36, cached outside the repo. Idempotent; prints the
# directory holding the binaries (llama-completion, llama-simple, llama-perplexity, llama-quantize, llama-embedding ...).
set -euo pipefail
CACHE="${CAWSFS_CACHE:-$HOME/.cache/cawsfs}"
VER=0.3.36
SRC="$CACHE/llama.cpp-$VER"
BUILD="$SRC/build"
BIN="$BUILD/bin"
TOOLS=(llama-completion llama-simple llama-perplexity llama-tokenize llama-quantize llama-imatrix llama-embedding)
have_all() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
# llama-embedding prints its output through llama.cpp's logger, whose worker thread it
# never flushes before exiting (common/log.h: "Call common_log_flush() before exit if
# you want to ensure all logs are flushed"): on a busy machine its JSON comes out cut
# short. One line before its final return flushes it; nothing else changes.
EMB="$SRC/examples/embedding/embedding.cpp"
FLUSH='    common_log_flush(common_log_main()); // cawsfs: flush before exit'
patched() { grep -qF "$FLUSH" "$EMB" 2>/dev/null; }
if ! have_all || ! patched; then
  command -v cmake >/dev/null || { echo "build-llama-cpp: cmake is missing (apt-get install cmake)" >&2; exit 1; }
  mkdir -p "$CACHE/dl"
  sdist="$CACHE/dl/llama_cpp_python-$VER.tar.gz"
  [ -s "$sdist" ] || python3 -m pip download --quiet --no-deps "llama-cpp-python==$VER" -d "$CACHE/dl" >&2
  if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tmp=$(mktemp -d "$CACHE/unpack.XXXXXX")
    tar -xzf "$sdist" -C "$tmp" "llama_cpp_python-$VER/vendor/llama.cpp"
    rm -rf "$SRC"
    mv "$tmp/llama_cpp_python-$VER/vendor/llama.cpp" "$SRC"
    rm -rf "$tmp"
  fi
  if ! patched; then
    python3 - "$EMB" "$FLUSH" <<'PY'
import sys
path, line = sys.argv[1], sys.argv[2]
src = open(path).read()
end = "\n    return 0;\n}\n"
if src.count(end) != 1:
    sys.exit(f"build-llama-cpp: {path}: no single final 'return 0;' to flush before")
open(path, "w").write(src.replace(end, "\n" + line + end))
PY
  fi
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  cmake --build "$BUILD" --config Release -j "$(nproc)" --target "${TOOLS[@]}" >&2
  have_all && patched || { echo "build-llama-cpp: build finished but tools are missing in $BIN" >&2; exit 1; }
fi
echo "$BIN"
