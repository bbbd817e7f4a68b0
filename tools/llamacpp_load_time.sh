#!/usr/bin/env bash
# The llama.cpp baseline of Conveyor's start time: builds llama.cpp's llama-completion
# from source (the copy vendored in the llama-cpp-python sdist, fetched with pip) and
# times it loading a GGUF file and generating one token with 2 threads, as a user runs
# it: the wall time of the whole process and llama.cpp's own printed "load time",
# best of N with a warm page cache. Prints the binary's path last, for
#   conveyor bench start --model FILE --llama-cpp PATH
# which times Conveyor and llama.cpp back to back in one run.
#
#   tools/llamacpp_load_time.sh                        the Gemma 3 270M file, 3 runs
#   tools/llamacpp_load_time.sh FILE.gguf 5            another file, 5 runs
#   LLAMACPP_DIR=/tmp/lcpp THREADS=2 tools/llamacpp_load_time.sh
#
# Built without -march=native on purpose: on this machine's CPUs the native build turns
# on llama.cpp's AMX kernels, which crash (SIGSEGV in ggml_backend_amx_mul_mat) on the
# first token; the explicit AVX-512 set below is the same code minus AMX.
set -euo pipefail
model=${1:-$HOME/.cache/conveyor/gemma-3-270m-q4_k_m.gguf}
runs=${2:-3}
threads=${THREADS:-2}
dir=${LLAMACPP_DIR:-/tmp/llamacpp_baseline}
version=${LLAMACPP_PYTHON_VERSION:-0.3.36}
python=${PYTHON:-python}
[ -f "$model" ] || { echo "model file not found: $model" >&2; exit 2; }
command -v cmake >/dev/null || { echo "cmake not found" >&2; exit 2; }
mkdir -p "$dir"
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$src" ]; then
  "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir" >&2
  tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
bin="$src/build-cpu/bin/llama-completion"
if [ ! -x "$bin" ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
  if grep -q avx512vnni /proc/cpuinfo; then
    flags+=(-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
  fi
  cmake -S "$src" -B "$src/build-cpu" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF "${flags[@]}" "${launcher[@]}" >&2
  nice -n 10 cmake --build "$src/build-cpu" -j"$(nproc)" --target llama-completion >&2
fi
cat "$model" >/dev/null  # warm the page cache
echo "model: $model  threads: $threads  load average: $(cut -d' ' -f1 /proc/loadavg)"
best_wall= best_load=
for i in $(seq "$runs"); do
  log=$(mktemp)
  start=$(date +%s.%N)
  "$bin" -m "$model" -t "$threads" -n 1 -p "Hello" -no-cnv >"$log" 2>&1 || { tail -5 "$log" >&2; rm -f "$log"; exit 1; }
  end=$(date +%s.%N)
  wall=$(echo "$end - $start" | bc)
  load=$(sed -n 's/.*load time = *\([0-9.]*\) ms.*/\1/p' "$log" | head -1)
  rm -f "$log"
  printf 'run %d  wall %.3f s  llama.cpp load time %.3f s\n' "$i" "$wall" "$(echo "$load / 1000" | bc -l)"
  if [ -z "$best_wall" ] || [ "$(echo "$wall < $best_wall" | bc)" = 1 ]; then best_wall=$wall; fi
  if [ -z "$best_load" ] || [ "$(echo "$load < $best_load" | bc)" = 1 ]; then best_load=$load; fi
done
printf 'best of %d: wall %.3f s  llama.cpp load time %.3f s\n' "$runs" "$best_wall" "$(echo "$best_load / 1000" | bc -l)"
echo "$bin"
