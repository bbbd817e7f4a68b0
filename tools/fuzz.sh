#!/usr/bin/env bash
# Builds and runs conveyor's fuzz targets.
#
#   tools/fuzz.sh                     every target for 10 s (a smoke run)
#   tools/fuzz.sh -t 120 llama2c      one target for 2 minutes
#   tools/fuzz.sh --replay            run each file of tests/fuzz_corpus/<target>/ once
#
# C targets (csrc/fuzz/fuzz_<name>.c, LLVMFuzzerTestOneInput):
#   safetensors  the safetensors header reader (cv_st_parse)
#   config       HF config.json parsing (cv_hf_config_parse, the JSON parser)
#   llama2c      the llama2.c checkpoint reader (cv_llama2c_parse)
#   gguf         the GGUF reader and checkpoint (cv_gguf_parse, cv_gguf_checkpoint_parse)
#   stop         the stop-string matcher against brute-force references
# Python target:
#   tokenizer    conveyor.tokenizer.Llama2cTokenizer loading corrupted tokenizer.bin
#                files (atheris when importable, else a plain random mutation loop);
#                only ModelFormatError/ValueError may come out, and a file that loads
#                must encode and decode.
# Python targets of tools/fuzz_model_files.py, each input under a 5 s and a
# 512 MiB limit so that a blow-up is a failure:
#   gguf_tokenizer  GGUF metadata (py_gguf.c) -> the GGUF tokenizer; the Python GGUFReader
#   hf_tokenizer    tokenizer.json + tokenizer_config.json -> HFTokenizer
#   chat_template   chat templates built from hostile pieces -> the template renderer
#   shard_index     model.safetensors.index.json -> the C checkpoint reader
#
# With clang and libFuzzer (-fsanitize=fuzzer) the C targets are built with
# -fsanitize=fuzzer,address,undefined. Without them, with gcc (or any compiler with
# ASan) and a small standalone driver (written below) that mutates the seed corpus
# at random for the given time, or replays files. Each target starts from its
# regression corpus tests/fuzz_corpus/<target>/ (seeds, and inputs that once
# crashed); new inputs go to $CV_FUZZ_DIR/corpus/<target>/ (default /tmp/cv_fuzz),
# crashes to $CV_FUZZ_DIR/crashes/<target>/. The exit status is 1 when any target
# crashed; keep a crash's input as tests/fuzz_corpus/<target>/crash_<what> once fixed.
#
# Environment: CV_FUZZ_DIR, CC (compiler; default clang when it links libFuzzer,
# else gcc), PYTHON (for the tokenizer target; conveyor must be importable),
# CV_FUZZ_ENGINE=libfuzzer|standalone to force one.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

usage() { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; }

secs=10
mode=fuzz
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    -t|--time) secs=$2; shift 2 ;;
    --replay) mode=replay; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
py_targets=(gguf_tokenizer hf_tokenizer chat_template shard_index)
all=(safetensors config llama2c gguf stop tokenizer "${py_targets[@]}")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
for t in "${targets[@]}"; do
  case " ${all[*]} " in *" $t "*) ;; *) echo "fuzz.sh: unknown target '$t' (${all[*]})" >&2; exit 2 ;; esac
done

# The tools run without a sanitizer runtime preloaded (tools/sanitize.sh sets one).
unset LD_PRELOAD
out=${CV_FUZZ_DIR:-/tmp/cv_fuzz}
mkdir -p "$out"
py=${PYTHON:-python3}

# ---------------------------------------------------------------- the C toolchain
try_link() {  # $1 compiler, $2.. flags: can it build a fuzz target?
  local cc=$1; shift
  printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' \
    > "$out/probe.c"
  "$cc" "$@" "$out/probe.c" -o "$out/probe" >/dev/null 2>&1
}

engine=${CV_FUZZ_ENGINE:-}
cc=${CC:-}
if [ -z "$engine" ]; then
  if command -v "${cc:-clang}" >/dev/null 2>&1 && try_link "${cc:-clang}" -fsanitize=fuzzer,address,undefined; then
    engine=libfuzzer
  else
    engine=standalone
  fi
fi
if [ "$engine" = libfuzzer ]; then
  cc=${cc:-clang}
  cflags=(-std=c11 -g -O1 -D_GNU_SOURCE -fno-omit-frame-pointer -fsanitize=address,undefined
          -fno-sanitize-recover=undefined -Icsrc -Ikernels)
  objflags=(-fsanitize=fuzzer-no-link)
  linkflags=(-fsanitize=fuzzer,address,undefined)
else
  if [ -z "$cc" ]; then
    if command -v gcc >/dev/null 2>&1; then cc=gcc; else cc=clang; fi
  fi
  cflags=(-std=c11 -g -O1 -D_GNU_SOURCE -fno-omit-frame-pointer -fsanitize=address,undefined
          -fno-sanitize-recover=undefined -Icsrc -Ikernels)
  objflags=()
  linkflags=(-fsanitize=address,undefined)
fi
bdir=$out/build-$engine-$(basename "$cc")
mkdir -p "$bdir"

# The standalone driver: replays files, or mutates a corpus for some seconds.
write_driver() {
  cat > "$bdir/driver.c.new" <<'EOF'
/* Standalone driver for conveyor's libFuzzer targets, for machines without
 * libFuzzer (written by tools/fuzz.sh).
 *   driver FILE...                    runs each file once
 *   driver -time=SECS -crash=PREFIX DIR...
 *       mutates the files of the DIRs at random for SECS seconds; an input that
 *       makes a sanitizer report is saved as PREFIX<n> before the process dies. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sanitizer/common_interface_defs.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t *cur;       /* [cur_n] the input being run */
static size_t cur_n;
static const char *crash_prefix;

static void on_death(void) {
    if (!crash_prefix || !cur) return;
    char path[4096];
    snprintf(path, sizeof path, "%scrash-%ld", crash_prefix, (long)time(NULL));
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(cur, 1, cur_n, f);
        fclose(f);
        fprintf(stderr, "driver: the crashing input is in %s\n", path);
    }
}

static int read_file(const char *path, uint8_t **out, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 4096, len = 0;
    uint8_t *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (len < cap) break;
        uint8_t *nb = realloc(buf, cap * 2);
        if (!nb) { free(buf); buf = NULL; break; }
        buf = nb;
        cap *= 2;
    }
    fclose(f);
    if (!buf) return -1;
    *out = buf;
    *n = len;
    return 0;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return rng;
}

static const int64_t interesting[] = {0, 1, -1, 2, 4, 7, 8, 16, 255, 256, 4096, 65535, 65536,
                                      0x7fffffff, -0x7fffffffll - 1, 0x80000000ll, 0xffffffffll,
                                      0x7fffffffffffffffll, 1ll << 40};

/* One random edit of buf (capacity cap, length *n). */
static void mutate(uint8_t *buf, size_t *n, size_t cap) {
    size_t len = *n;
    switch (next() % 8) {
    case 0: if (len) buf[next() % len] ^= (uint8_t)(1u << (next() % 8)); break;
    case 1: if (len) buf[next() % len] = (uint8_t)next(); break;
    case 2: if (len) { static const uint8_t b[] = {0, 0xff, 0x7f, 0x80, '"', '{', '}', '[', ']', ',', ':', '\\', '0', '9', '-', 'e'};
                       buf[next() % len] = b[next() % sizeof b]; } break;
    case 3: if (len >= 8) { int64_t v = interesting[next() % (sizeof interesting / sizeof *interesting)];
                            size_t w = (next() & 1) ? 8 : 4; size_t at = next() % (len - w + 1);
                            memcpy(buf + at, &v, w); } break;
    case 4: if (len) *n = next() % len; break;                       /* truncate */
    case 5: if (len > 1) { size_t at = next() % len, k = 1 + next() % (len - at);
                           memmove(buf + at, buf + at + k, len - at - k); *n = len - k; } break;
    case 6: if (len && len < cap) { size_t at = next() % len, k = 1 + next() % (cap - len < 64 ? cap - len : 64);
                                    if (k > len - at) k = len - at;
                                    memmove(buf + at + k, buf + at, len - at); *n = len + k; } break;
    default: if (len > 2) { size_t a = next() % len, b = next() % len, k = 1 + next() % 16;
                            if (a + k > len) k = len - a; if (b + k > len) k = len - b;
                            memmove(buf + b, buf + a, k); } break;
    }
}

int main(int argc, char **argv) {
    double secs = -1;
    int first = 1;
    for (; first < argc && argv[first][0] == '-'; first++) {
        if (!strncmp(argv[first], "-time=", 6)) secs = atof(argv[first] + 6);
        else if (!strncmp(argv[first], "-crash=", 7)) crash_prefix = argv[first] + 7;
        else { fprintf(stderr, "driver: unknown option %s\n", argv[first]); return 2; }
    }
    __sanitizer_set_death_callback(on_death);
    if (secs < 0) { /* replay */
        int n_run = 0;
        for (int i = first; i < argc; i++) {
            uint8_t *d;
            size_t n;
            if (read_file(argv[i], &d, &n)) { fprintf(stderr, "driver: cannot read %s\n", argv[i]); return 2; }
            cur = d; cur_n = n;
            LLVMFuzzerTestOneInput(d, n);
            cur = NULL;
            free(d);
            n_run++;
        }
        printf("driver: replayed %d input(s), no failure\n", n_run);
        return 0;
    }
    /* load the seeds */
    uint8_t **seeds = NULL;
    size_t *seed_n = NULL, n_seeds = 0, max_n = 64;
    for (int i = first; i < argc; i++) {
        DIR *dir = opendir(argv[i]);
        if (!dir) continue;
        struct dirent *e;
        while ((e = readdir(dir))) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], e->d_name);
            uint8_t *d;
            size_t n;
            if (read_file(path, &d, &n)) continue;
            uint8_t **ns = realloc(seeds, (n_seeds + 1) * sizeof *ns);
            size_t *nn = realloc(seed_n, (n_seeds + 1) * sizeof *nn);
            if (ns) seeds = ns;
            if (nn) seed_n = nn;
            if (!ns || !nn) { free(d); break; }
            seeds[n_seeds] = d;
            seed_n[n_seeds++] = n;
            if (n > max_n) max_n = n;
        }
        closedir(dir);
    }
    size_t cap = max_n * 2 + 64;
    uint8_t *buf = malloc(cap);
    if (!buf) return 2;
    rng ^= (uint64_t)time(NULL) * 0x2545F4914F6CDD1Dull;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long execs = 0;
    for (;;) {
        size_t n = 0;
        if (n_seeds) {
            size_t k = next() % n_seeds;
            n = seed_n[k];
            memcpy(buf, seeds[k], n);
        }
        int edits = 1 + (int)(next() % 8);
        for (int i = 0; i < edits; i++) mutate(buf, &n, cap);
        /* an exact-size copy so ASan sees reads past the end */
        cur = malloc(n ? n : 1);
        if (!cur) break;
        memcpy(cur, buf, n);
        cur_n = n;
        LLVMFuzzerTestOneInput(cur, n);
        free(cur);
        cur = NULL;
        execs++;
        if ((execs & 255) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            double el = (double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) * 1e-9;
            if (el >= secs) {
                printf("stat::number_of_executed_units: %lld\nstat::average_exec_per_sec: %.0f\n", execs, execs / el);
                break;
            }
        }
    }
    for (size_t i = 0; i < n_seeds; i++) free(seeds[i]);
    free(seeds);
    free(seed_n);
    free(buf);
    return 0;
}
EOF
  if ! cmp -s "$bdir/driver.c.new" "$bdir/driver.c" 2>/dev/null; then mv "$bdir/driver.c.new" "$bdir/driver.c"; else rm "$bdir/driver.c.new"; fi
}

model_srcs=(csrc/model/safetensors.c csrc/model/json.c csrc/model/checkpoint.c csrc/model/checkpoint_open.c csrc/model/mapped_file.c csrc/model/checkpoint_hf.c
            csrc/model/checkpoint_llama2c.c csrc/model/gguf.c csrc/model/checkpoint_gguf.c base/common.c base/quant_format.c)
stop_srcs=(csrc/core/stop.c)

# newer SRC... than OUT?
stale() {
  local o=$1; shift
  [ -e "$o" ] || return 0
  local s
  for s in "$@"; do [ "$s" -nt "$o" ] && return 0; done
  return 1
}

# Compiles a library source once per build folder.
obj() {
  local src=$1 o
  o="$bdir/obj/$(echo "$src" | tr / _).o"
  mkdir -p "$bdir/obj"
  if stale "$o" "$src" base/*.h csrc/model/*.h csrc/core/*.h kernels/*.h; then
    "$cc" "${cflags[@]}" "${objflags[@]}" -c "$src" -o "$o"
  fi
  echo "$o"
}

build_c() {  # $1 target -> path of the binary
  local t=$1 srcs objs=() s bin extra=()
  if [ "$t" = stop ]; then srcs=("${stop_srcs[@]}"); else srcs=("${model_srcs[@]}"); fi
  for s in "${srcs[@]}"; do objs+=("$(obj "$s")"); done
  if [ "$engine" = standalone ]; then
    write_driver
    extra=("$bdir/driver.c")
  fi
  bin=$bdir/fuzz_$t
  if stale "$bin" "csrc/fuzz/fuzz_$t.c" "${objs[@]}" "${extra[@]}"; then
    "$cc" "${cflags[@]}" "${objflags[@]}" "csrc/fuzz/fuzz_$t.c" "${extra[@]}" "${objs[@]}" \
      "${linkflags[@]}" -lm -o "$bin"
  fi
  echo "$bin"
}

# ---------------------------------------------------------------- the Python target
write_tokenizer_harness() {
  cat > "$out/fuzz_tokenizer.py" <<'EOF'
"""Fuzzes conveyor.tokenizer.Llama2cTokenizer (written by tools/fuzz.sh).

python fuzz_tokenizer.py SECS WORKDIR CRASHDIR CORPUSDIR...  (atheris when importable)"""
import os
import random
import sys
import time

try:
    import atheris
except ImportError:
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["conveyor"]):
        from conveyor import ModelFormatError
        from conveyor.tokenizer import Llama2cTokenizer
else:
    from conveyor import ModelFormatError
    from conveyor.tokenizer import Llama2cTokenizer

secs, work, crashes, corpora = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
os.makedirs(work, exist_ok=True)
os.makedirs(crashes, exist_ok=True)
shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else work
scratch = os.path.join(shm, f"cv_fuzz_tok_{os.getpid()}.bin")


def one(data: bytes):
    """Loading may fail with ModelFormatError/ValueError only; a file that loads must
    encode and decode. The first byte picks the vocab_size the model header would give."""
    with open(scratch, "wb") as f:
        f.write(data[1:])
    vocab = None if not data or data[0] < 128 else 200 + data[0]
    try:
        tok = Llama2cTokenizer(scratch, vocab)
    except (ModelFormatError, ValueError):
        return
    text = data[1:40].decode("utf-8", "replace")
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids), ids
    tok.decode(ids)
    tok.decode(list(range(min(tok.vocab_size, 300))), skip_special_tokens=False)
    tok.all_token_bytes()


def mutate(b: bytearray, rnd: random.Random) -> bytearray:
    for _ in range(rnd.randint(1, 8)):
        k = rnd.randrange(6)
        if k == 0 and b:
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        elif k == 1 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif k == 2 and len(b) >= 4:
            at = rnd.randrange(len(b) - 3)
            b[at:at + 4] = rnd.choice([0, 1, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 0x7f800000, 0x7fc00000]).to_bytes(4, "little")
        elif k == 3 and b:
            del b[rnd.randrange(len(b)):]
        elif k == 4 and b:
            at = rnd.randrange(len(b))
            del b[at:at + rnd.randint(1, 16)]
        else:
            at = rnd.randrange(len(b) + 1)
            b[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
    return b


seeds = []
for d in corpora:
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                seeds.append(b"\x00" + f.read())  # byte 0: vocab_size from the file
try:
    if atheris is not None:
        def test_one(data):
            one(bytes(data))

        atheris.Setup([sys.argv[0], f"-max_total_time={int(max(1, secs))}", "-print_final_stats=1",
                       "-max_len=8192", f"-artifact_prefix={crashes}/", work] + corpora, test_one)
        atheris.Fuzz()
    else:
        rnd = random.Random()
        for s in seeds:
            one(s)
        t0, n = time.monotonic(), 0
        while time.monotonic() - t0 < secs:
            data = bytes(mutate(bytearray(rnd.choice(seeds) if seeds else b""), rnd))
            try:
                one(data)
            except BaseException:
                path = os.path.join(crashes, f"crash-{int(time.time())}")
                with open(path, "wb") as f:
                    f.write(data)
                print(f"fuzz_tokenizer: crashing input saved as {path}", file=sys.stderr)
                raise
            n += 1
        el = time.monotonic() - t0
        print(f"stat::number_of_executed_units: {n}\nstat::average_exec_per_sec: {n / el:.0f}")
finally:
    if os.path.exists(scratch):
        os.unlink(scratch)
EOF
}

# ---------------------------------------------------------------- run
status=0
summary=()
printf 'fuzz.sh: %s, engine %s (%s)\n' "$mode" "$engine" "$cc" >&2
for t in "${targets[@]}"; do
  seeds=$root/tests/fuzz_corpus/$t
  work=$out/corpus/$t
  crashes=$out/crashes/$t
  log=$out/$t.log
  mkdir -p "$work" "$crashes"
  t0=$(date +%s)
  if [[ " ${py_targets[*]} " == *" $t "* ]]; then
    if ! "$py" -c "import conveyor.tokenizer" >/dev/null 2>&1; then
      echo "fuzz.sh: $t: conveyor is not importable with $py (set PYTHON/PYTHONPATH); skipped" >&2
      summary+=("$t skipped (conveyor not importable)")
      continue
    fi
    set +e
    "$py" "$root/tools/fuzz_model_files.py" "$t" "$([ "$mode" = replay ] && echo 0 || echo "$secs")" \
      "$work" "$crashes" "$seeds" > "$log" 2>&1
    rc=$?
    set -e
  elif [ "$t" = tokenizer ]; then
    if ! "$py" -c "import conveyor.tokenizer" >/dev/null 2>&1; then
      echo "fuzz.sh: tokenizer: conveyor is not importable with $py (set PYTHON/PYTHONPATH); skipped" >&2
      summary+=("tokenizer skipped (conveyor not importable)")
      continue
    fi
    write_tokenizer_harness
    if [ "$mode" = replay ]; then
      set +e
      "$py" "$out/fuzz_tokenizer.py" 0 "$work" "$crashes" "$seeds" > "$log" 2>&1
      rc=$?
      set -e
    else
      set +e
      "$py" "$out/fuzz_tokenizer.py" "$secs" "$work" "$crashes" "$seeds" > "$log" 2>&1
      rc=$?
      set -e
    fi
  else
    bin=$(build_c "$t")
    set +e
    if [ "$mode" = replay ]; then
      files=("$seeds"/*)
      if [ ! -e "${files[0]}" ]; then files=(); fi
      if [ "$engine" = libfuzzer ]; then
        "$bin" -runs=1 "${files[@]}" > "$log" 2>&1
      else
        "$bin" "${files[@]}" > "$log" 2>&1
      fi
    elif [ "$engine" = libfuzzer ]; then
      "$bin" -max_total_time="$secs" -print_final_stats=1 -max_len=16384 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$crashes/" "$work" "$seeds" > "$log" 2>&1
    else
      "$bin" -time="$secs" -crash="$crashes/" "$seeds" "$work" > "$log" 2>&1
    fi
    rc=$?
    set -e
  fi
  el=$(( $(date +%s) - t0 ))
  if [ "$mode" = replay ]; then
    n=$(find "$seeds" -maxdepth 1 -type f | wc -l)
    line="$t: replayed $n file(s)"
  else
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$log" | tail -1 || true)
    line="$t: ${execs:-?} execs in ${el} s (${rate:-?}/s)${cov:+, $cov}"
  fi
  if [ $rc -ne 0 ]; then
    status=1
    line="$line -- FAILED (exit $rc), log $log; inputs in $crashes"
    echo "---- $t: last lines of $log" >&2
    tail -40 "$log" >&2
  fi
  summary+=("$line")
done
printf '%s\n' "${summary[@]}"
exit $status
