#!/usr/bin/env bash
# Install everything the tests and the demo need on a fresh machine, skipping what is
# already there: Debian packages (cmake, fuse3, zstd, time, nginx: the HTTP server the
# remote-archive tests start), s3s-fs (an S3 server over a directory, from crates.io, for
# the same tests), Python packages (numpy, gguf,
# safetensors, torch, transformers, pytest, zstandard, xxhash; sentencepiece and protobuf,
# which make and convert SentencePiece tokenizers; sentence-transformers, a client), the
# test model and the llama.cpp build.
# Heavy downloads and builds are cached under ~/.cache/cawsfs, outside the repo.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
command -v c++ >/dev/null || need_apt+=(g++)
command -v zstd >/dev/null || need_apt+=(zstd)
[ -x /usr/bin/time ] || need_apt+=(time)
[ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >&2
fi

py_pkgs=(numpy gguf safetensors torch transformers pytest zstandard xxhash sentencepiece protobuf
  sentence-transformers)
if ! python3 -c "import numpy, gguf, safetensors, torch, transformers, pytest, zstandard, xxhash, sentencepiece, google.protobuf, sentence_transformers" 2>/dev/null; then
  echo "setup: pip install ${py_pkgs[*]}" >&2
  python3 -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}" >&2
fi

# 0.15 and later need a newer rustc than the project's floor; 0.14.1 checks SigV4.
if ! command -v s3s-fs >/dev/null && [ ! -x "$HOME/.cargo/bin/s3s-fs" ]; then
  echo "setup: cargo install s3s-fs@0.14.1" >&2
  cargo install --quiet s3s-fs@0.14.1 --features binary --locked >&2
fi

"$here/fetch-test-model.sh" >/dev/null
"$here/build-llama-cpp.sh" >/dev/null
echo "setup: ok" >&2
