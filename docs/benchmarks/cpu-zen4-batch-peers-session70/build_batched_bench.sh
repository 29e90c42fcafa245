#!/usr/bin/env bash
# llama.cpp's llama-batched-bench, the one tool peers.py needs beyond ../shared/peers/build_llama_cpp.sh's: the same
# source (the llama.cpp vendored in the llama-cpp-python sdist), the same native configure, one more ninja target,
# copied beside the other peer binaries. About 4 min on 2 quiet cores.
#   bash docs/benchmarks/cpu-zen4-batch-peers-session70/build_batched_bench.sh [PREFIX]
set -euo pipefail
prefix=${1:-$HOME/.cache/medusa-peers/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
work=$(mktemp -d)
python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >/dev/null
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
ninja -C "$work/build" -j"$(nproc)" llama-batched-bench
mkdir -p "$prefix/bin"
cp "$work/build/bin/llama-batched-bench" "$prefix/bin/"
rm -rf "$work"
echo "built: $prefix/bin/llama-batched-bench"
