#!/usr/bin/env bash
# Runs the test suite against a sanitized conveyor._core: AddressSanitizer,
# UndefinedBehaviorSanitizer and LeakSanitizer.
#
#   tools/sanitize.sh                      the whole suite (tests/, -q)
#   tools/sanitize.sh tests/test_engine.py -x -k greedy     any pytest arguments
#
# It builds a private copy with CONVEYOR_SANITIZE=1 (setup.py adds
# -fsanitize=address,undefined -fno-sanitize-recover=undefined -g) into
# /tmp/cv_build_$CV_SANITIZE_NAME (default "asan", through tools/dev_build.sh, so
# the checkout and other builds are untouched; the CUDA backend is left out), then
# runs pytest with
#   LD_PRELOAD=$(gcc -print-file-name=libasan.so)   the interpreter is not instrumented,
#                                                    so the ASan runtime must come first
#   PYTHONMALLOC=malloc                              Python objects through malloc, so ASan
#                                                    also sees the binding misuse them
#   ASAN_OPTIONS=detect_leaks=1:...                  LSan at exit, with tools/lsan.supp
#   UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# Any ASan/UBSan report stops the process with a stack; a leak fails the exit code.
#
# Environment: PYTHON (default python3; needs setuptools, numpy and the test
# dependencies), CC (the compiler whose libasan is preloaded; default gcc, the
# one setup.py uses), CV_SANITIZE_NAME, CV_SANITIZE_ALL=1 to also run the tests
# that are deselected below as too slow under ASan.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
cc=${CC:-gcc}
name=${CV_SANITIZE_NAME:-asan}

asan=$("$cc" -print-file-name=libasan.so)
if [ ! -e "$asan" ]; then
  echo "sanitize.sh: $cc has no libasan.so ($asan); install its sanitizer runtime (libasan8)" >&2
  exit 2
fi
asan=$(realpath "$asan")
# C++ extensions loaded later (matplotlib's ft2font, the tokenizers' runtime) throw
# exceptions: ASan intercepts __cxa_throw and needs libstdc++ present at start-up.
preload=$asan
stdcxx=$("$cc" -print-file-name=libstdc++.so)
if [ -e "$stdcxx" ]; then preload="$preload:$(realpath "$stdcxx")"; fi

echo "sanitize.sh: building a sanitized conveyor._core and conveyor._testing into /tmp/cv_build_$name" >&2
lib=$(CONVEYOR_SANITIZE=1 CONVEYOR_CUDA=0 PYTHON="$py" CC="$cc" tools/dev_build.sh "$name")
for so in "$lib"/conveyor/_core*.so "$lib"/conveyor/_testing*.so; do
  if ! nm -D "$so" | grep __asan_init >/dev/null; then
    echo "sanitize.sh: $so is not instrumented" >&2
    exit 2
  fi
done

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(tests -q)
fi
# Not run under ASan by default: the libFuzzer smoke run and the corpus replays
# build their own ASan/UBSan binaries (and take a minute). CV_SANITIZE_ALL=1 keeps
# them. (tests/test_soak.py does run; it skips its RSS check under ASan, whose
# quarantine keeps freed memory resident.)
# tests/test_ray.py never runs here: LD_PRELOAD would put ASan into Ray's own uninstrumented
# daemons (raylet, GCS), whose reports are not ours; the engine it drives is the AsyncLLM
# that test_async.py and test_server.py run under ASan.
deselect=(--deselect tests/test_ray.py)
if [ "${CV_SANITIZE_ALL:-0}" != 1 ]; then
  deselect+=(
    --deselect tests/test_fuzz_smoke.py::test_fuzz_smoke_5s_per_target
    --deselect tests/test_fuzz_smoke.py::test_fuzz_corpus_replays
  )
fi

export PYTHONPATH="$lib${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc
# allocator_may_return_null: a huge request (max_num_seqs=10**12) must fail as
# MemoryError, as it does without ASan, instead of ASan aborting the process.
# Reports go to files: pytest captures fd 2 while a test runs, and a report
# written there dies with the process.
reports=$(mktemp -d /tmp/cv_sanitize_reports.XXXXXX)
export ASAN_OPTIONS="log_path=$reports/asan:detect_leaks=1:allocator_may_return_null=1:halt_on_error=1:detect_stack_use_after_return=0:check_initialization_order=1:strict_string_checks=1:detect_odr_violation=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$root/tools/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="log_path=$reports/ubsan:halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# Subprocesses the tests start (servers, C compilers) inherit this; tests that
# build C code drop LD_PRELOAD for the compiler themselves.
export CONVEYOR_SANITIZED=1

junit=$(mktemp /tmp/cv_sanitize_junit.XXXXXX.xml)
# The suite passed by pytest's own count (its exit status is LSan's when the exit-time
# leak check dies): no failures or errors in the junit report.
suite_passed() {
  "$py" - "$junit" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sys.exit(0 if suites and bad == 0 else 1)
PYEOF
}

# Runs the suite once; sets rc (pytest's status, or 1 for a sanitizer report) and
# lsan_died (1 when the only trouble was LeakSanitizer failing to stop the world at
# exit: "LeakSanitizer has encountered a fatal error", an error of the checker, not a leak).
run_once() {
  echo "sanitize.sh: $py -m pytest ${args[*]} ${deselect[*]}" >&2
  set +e
  # LD_PRELOAD for the interpreter only (and what it starts), not for this script's tools.
  LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" "$py" -m pytest -p no:cacheprovider --junitxml="$junit" \
    "${args[@]}" "${deselect[@]}"
  rc=$?
  set -e
  # A report file holds errors, leaks, or only warnings (a huge allocation refused
  # under allocator_may_return_null, which the tests ask for on purpose).
  found=0
  died=0
  for f in "$reports"/*; do
    [ -e "$f" ] || continue
    if grep -E "ERROR: |runtime error: |CHECK failed" "$f" >/dev/null; then
      found=1
      echo "==== sanitizer report $f" >&2
      cat "$f" >&2
    else
      if grep -q "LeakSanitizer has encountered a fatal error" "$f"; then died=1; fi
      echo "sanitize.sh: warnings only in $f: $(sort -u "$f" | head -3 | tr '\n' ' ')" >&2
      rm "$f"
    fi
  done
  lsan_died=0
  if [ $found = 1 ]; then
    echo "sanitize.sh: sanitizer reports above (kept in $reports); pytest exit status $rc" >&2
    [ $rc -eq 0 ] && rc=1
  else
    echo "sanitize.sh: no sanitizer report; pytest exit status $rc" >&2
    if [ $rc -ne 0 ] && [ $died = 1 ] && suite_passed; then lsan_died=1; fi
  fi
}

run_once
if [ $lsan_died = 1 ]; then
  # Every test passed and no report was written, but the exit-time leak check itself
  # could not run. Once more, so that one full run ends with a leak check that ran.
  echo "sanitize.sh: every test passed, but LeakSanitizer died before its exit-time check; running once more" >&2
  run_once
fi
rm -f "$junit"
[ $found = 1 ] || rmdir "$reports" 2>/dev/null || true
exit $rc
