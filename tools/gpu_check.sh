#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine: build with CUDA,
# tests/test_cuda.py, then short benchmarks (device memcpy bandwidth, GEMM
# against the HBM bound, batch-1 and batch-256 decode of a TinyLlama-1.1B
# shaped random bf16 checkpoint, Workload V at one cap, and `conveyor bench study`
# against HF transformers on the GPU when torch and transformers are installed). Every
# stage runs under `timeout` so one failure does not eat the budget; the whole script
# is sized for < 8 minutes on one H200 (< 12 with the study).
#
# Results (logs, JSON, summary.txt) go to $OUT if set, else ./gpu_check_out.
# Knobs: PYTHON (default python3), HBM_TBPS (nominal bandwidth, default 4.8 for H200),
# GPU_CHECK_SKIP="test variance study" (stages to skip), GPU_CHECK_SMALL=1 (tiny sizes: a dry
# run of the script itself, e.g. on the CPU emulator with GPU_CHECK_SKIP=build,
# GPU_CHECK_LIB=<a build folder> and CONVEYOR_CUDA_LIB=<emulated library>).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-/tmp/cv_gpu_check}
mkdir -p "$WORK"
export HBM_TBPS=${HBM_TBPS:-4.8}
export GPU_CHECK_SMALL=${GPU_CHECK_SMALL:-0}
if [ "$GPU_CHECK_SMALL" = 1 ]; then export CV_SHAPE=tiny; else export CV_SHAPE=tinyllama-1.1b; fi
export CV_CKPT="$WORK/$CV_SHAPE-bf16"
LIB=${GPU_CHECK_LIB:-/tmp/cv_build_gpu/lib}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T_START=$(date +%s)

# stage NAME LIMIT_SECONDS CMD...: runs CMD with output in $OUT/NAME.log.
stage() {
    local name=$1 limit=$2
    shift 2
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "$name skipped" | tee -a "$SUMMARY"; return 0 ;; esac
    echo "== $name (limit ${limit}s, $(( $(date +%s) - T_START ))s elapsed)"
    local t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    local what=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMEOUT"
    [ $rc -ne 0 ] && [ "$what" = ok ] && what="FAILED"
    echo "$name: $what (rc=$rc, ${dt}s)" | tee -a "$SUMMARY"
    tail -n 12 "$OUT/$name.log"
    return $rc
}

stage env 60 bash -c '
    nvidia-smi || true
    (command -v nvcc >/dev/null && nvcc --version) || /usr/local/cuda/bin/nvcc --version || echo "no nvcc"
    '"$PY"' -c "import sys, numpy; print(sys.version); print(\"numpy\", numpy.__version__)"
    nproc; free -g'

# The build: a private build folder (does not touch the checkout); CONVEYOR_CUDA=1
# makes a failed CUDA build fail the stage instead of falling back to the CPU.
if ! stage build 420 env CONVEYOR_CUDA=1 PYTHON="$PY" MAKEFLAGS="-j$(nproc)" tools/dev_build.sh gpu; then
    echo "build failed: see $OUT/build.log" | tee -a "$SUMMARY"
    exit 1
fi
export PYTHONPATH="$LIB"

stage test 240 "$PY" -m pytest tests/test_cuda.py -q -p no:cacheprovider -ra \
    --junitxml="$OUT/test_cuda.xml"

# ------------------------------------------------------------------ benchmarks
cat > "$WORK/bench_kernels.py" <<'EOF'
"""Device memcpy bandwidth and GEMM/GEMV against the HBM bound (TinyLlama shapes)."""
import json, os
import numpy as np
from conveyor import _testing

out = os.environ["OUT"]
hbm = float(os.environ["HBM_TBPS"]) * 1e12
small = os.environ.get("GPU_CHECK_SMALL") == "1"
res = {"device": _testing.cuda_info()}
bw = _testing.cuda_memcpy_bandwidth(1 << (20 if small else 30), 10) * 1e9  # bytes read + written per second
res["memcpy_read_plus_write_GBps"] = bw / 1e9
print(f"device: {res['device']['device']}")
print(f"device memcpy: {bw / 1e9:.0f} GB/s (read + write), {bw / hbm:.0%} of the nominal {hbm / 1e12:.1f} TB/s")
rng = np.random.default_rng(0)
shapes = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (32000, 2048)}
if small:
    shapes = {"qkv": (96, 64), "down": (64, 176)}
rows = []
print(f"{'matrix':>8} {'dtype':>8} {'n':>5} {'us':>9} {'GB/s':>7} {'of memcpy':>9} {'TFLOP/s':>8}")
for name, (r, c) in shapes.items():
    w = (rng.standard_normal((r, c), dtype=np.float32) * 0.02).astype(np.float32)
    for dt in ("bfloat16", "float32"):
        mat = _testing.cuda_kernel_matrix(w, dt)
        for n in (1, 16, 256):
            x = rng.standard_normal((n, c), dtype=np.float32)
            t = _testing.cuda_kernel_matmul_time(mat, x, repeats=2 if small else 5, calls=1 if small else 20)
            wbytes = r * c * (2 if dt == "bfloat16" else 4)
            gbs = wbytes / t
            tf = 2.0 * r * c * n / t / 1e12
            rows.append(dict(matrix=name, dtype=dt, n=n, seconds=t, weight_GBps=gbs / 1e9,
                             fraction_of_memcpy=gbs / bw, tflops=tf))
            print(f"{name:>8} {dt:>8} {n:>5} {t * 1e6:9.1f} {gbs / 1e9:7.0f} {gbs / bw:9.0%} {tf:8.1f}")
        del mat
res["gemm"] = rows
with open(os.path.join(out, "bench_kernels.json"), "w") as f:
    json.dump(res, f, indent=1)
EOF
stage bench_kernels 120 "$PY" "$WORK/bench_kernels.py"

cat > "$WORK/make_ckpt.py" <<'EOF'
import os, time
from conveyor.testing import write_hf_checkpoint
p = os.environ["CV_CKPT"]
if not os.path.exists(os.path.join(p, "config.json")):
    t = time.time()
    write_hf_checkpoint(p, shape=os.environ["CV_SHAPE"], dtype="bfloat16")
    print(f"wrote {p} in {time.time() - t:.1f}s")
else:
    print(f"reusing {p}")
EOF
stage checkpoint 150 "$PY" "$WORK/make_ckpt.py"

cat > "$WORK/bench_decode.py" <<'EOF'
"""Batch-1 and batch-256 decode of the TinyLlama-shaped checkpoint against the bandwidth bound."""
import json, os, statistics, time
import numpy as np
import conveyor
from conveyor import _testing, SamplingParams
from conveyor.testing import SHAPES

out = os.environ["OUT"]
hbm = float(os.environ["HBM_TBPS"]) * 1e12
small = os.environ.get("GPU_CHECK_SMALL") == "1"
copy_bw = _testing.cuda_memcpy_bandwidth(1 << (20 if small else 30), 5) * 1e9 / 2  # read bandwidth seen by a copy
s = SHAPES[os.environ["CV_SHAPE"]]
hd = s["dim"] // s["n_heads"]
layer = (s["dim"] * (s["n_heads"] + 2 * s["n_kv_heads"]) * hd + s["n_heads"] * hd * s["dim"]
         + 3 * s["dim"] * s["hidden_dim"])
weights = (s["n_layers"] * layer + s["vocab_size"] * s["dim"]) * 2  # bf16, lm_head included, embedding not
kv_per_token = s["n_layers"] * 2 * s["n_kv_heads"] * hd * 2     # 16-bit cache assumed
t = time.time()
llm = conveyor.LLM(os.environ["CV_CKPT"], device="cuda", max_num_seqs=256)
print(f"load: {time.time() - t:.1f}s; stats: {llm.stats()}")
rng = np.random.default_rng(0)
P = 32


def tpot(o):
    m = o.metrics
    n = len(o.outputs[0].token_ids)
    return (m.finished_time - m.first_token_time) / (n - 1)


res = {"weights_bytes": weights, "kv_bytes_per_token": kv_per_token, "copy_read_GBps": copy_bw / 1e9}
for batch, new in (((1, 8), (8, 4)) if small else ((1, 256), (256, 128))):
    prompts = [rng.integers(3, s["vocab_size"], P).tolist() for _ in range(batch)]
    llm.generate(prompts[:min(batch, 8)], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True),
                        use_tqdm=False)
    wall = time.time() - t
    step = statistics.median(tpot(o) for o in outs)
    ctx = P + new / 2  # mean context during decode
    need = weights + batch * ctx * kv_per_token
    r = dict(batch=batch, new_tokens=new, wall_s=wall, step_s=step, tokens_per_s=batch / step,
             bytes_per_step=need, bound_nominal_s=need / hbm, bound_copy_s=need / copy_bw,
             fraction_of_nominal=need / hbm / step, fraction_of_copy=need / copy_bw / step)
    res[f"batch{batch}"] = r
    print(f"batch {batch:3d}: {step * 1e3:7.3f} ms/step, {batch / step:9.0f} tok/s; bound {need / hbm * 1e3:.3f} ms "
          f"(nominal {hbm / 1e12:.1f} TB/s) / {need / copy_bw * 1e3:.3f} ms (measured copy): "
          f"{need / hbm / step:.0%} / {need / copy_bw / step:.0%} of the bound; wall {wall:.1f}s")
llm.close()
with open(os.path.join(out, "bench_decode.json"), "w") as f:
    json.dump(res, f, indent=1)
EOF
stage bench_decode 150 "$PY" "$WORK/bench_decode.py"

cat > "$WORK/variance.py" <<'EOF'
"""Workload V at one cap (M=128): static vs continuous batching, same requests."""
import json, os, time
import numpy as np
import conveyor
from conveyor import SamplingParams

out = os.environ["OUT"]
small = os.environ.get("GPU_CHECK_SMALL") == "1"
N, P, M, CAP = (6, 16, 8, 8) if small else (int(os.environ.get("V_N", "200")), 512, 128, 128)
vocab = 512 if small else 32000
rng = np.random.default_rng(1234)
lens = []
while len(lens) < N:
    x = int(np.ceil(rng.exponential(M)))
    if 1 <= x <= CAP:
        lens.append(x)
prompts = [rng.integers(3, vocab, P).tolist() for _ in range(N)]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
res = {"N": N, "P": P, "M": M, "cap": CAP, "systems": {}}
for name, kw in (("static-12", dict(scheduling="static", max_num_seqs=12)), ("continuous", dict())):
    llm = conveyor.LLM(os.environ["CV_CKPT"], device="cuda", **kw)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t
    llm.close()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    lat = sorted(o.metrics.finished_time - o.metrics.arrival_time for o in outs)
    r = dict(wall_s=wall, output_tok_s=gen / wall, total_tok_s=(gen + N * P) / wall,
             p50_latency_s=float(np.percentile(lat, 50)), generated=gen)
    res["systems"][name] = r
    print(f"{name:>10}: {wall:6.1f}s  output {gen / wall:8.0f} tok/s  total {(gen + N * P) / wall:8.0f} tok/s  "
          f"p50 latency {r['p50_latency_s']:.2f}s")
st, co = res["systems"]["static-12"], res["systems"]["continuous"]
print(f"continuous / static output throughput: {co['output_tok_s'] / st['output_tok_s']:.2f}x")
with open(os.path.join(out, "variance.json"), "w") as f:
    json.dump(res, f, indent=1)
EOF
# The engine's own benchmark when it exists with the needed options, else the snippet.
if "$PY" -m conveyor bench variance --help 2>/dev/null | grep -q -- "--device" &&
   "$PY" -m conveyor bench variance --help 2>/dev/null | grep -q -- "--caps"; then
    if [ "$GPU_CHECK_SMALL" = 1 ]; then
        VARGS="--num-requests 6 --prompt-len 16 --mean-output 8 --caps 8 --static-sizes 4"
    else
        VARGS="--num-requests 200 --prompt-len 512 --mean-output 128 --caps 128 --static-sizes 12"
    fi
    # shellcheck disable=SC2086
    stage variance 150 "$PY" -m conveyor bench variance --device cuda --model "$CV_CKPT" $VARGS \
        --sweep "" --json "$OUT/variance.json" --plot ""
else
    stage variance 150 "$PY" "$WORK/variance.py"
fi

# The study against the real baseline: HF transformers generate() on the GPU (naive static
# batching), Conveyor static and continuous on the GPU, vLLM if importable; the same
# SmolLM-135M-shaped bf16 checkpoint and token ids for all (conveyor bench study). Needs
# torch with CUDA and transformers on the machine (the `peers` extra); skipped otherwise.
if "$PY" -c "import torch, transformers, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    if [ "$GPU_CHECK_SMALL" = 1 ]; then
        SARGS="--quick"
    else
        SARGS="--num-requests 64 --prompt-len 128 --mean-output 128 --caps 32,128,512 --batch-size 16"
    fi
    # shellcheck disable=SC2086
    stage study 240 "$PY" -m conveyor bench study --device cuda $SARGS --markdown \
        --json "$OUT/study.json" --plot "$OUT/study.png"
else
    echo "study skipped: torch with CUDA and transformers are not importable (pip install '.[peers]')" |
        tee -a "$SUMMARY"
fi

echo "total $(( $(date +%s) - T_START ))s" | tee -a "$SUMMARY"
echo "results in $OUT"
