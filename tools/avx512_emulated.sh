#!/usr/bin/env bash
# Development: runs tests against a conveyor._core whose AVX-512 and
# AVX512_BF16 kernels run on portable intrinsics (SIMDe, Debian package
# libsimde-dev, plus build_support/avx512_emu/avx512_emu.h), so the kernels this CPU
# cannot execute are still checked against the plain-C ones. Slow; not a
# measure of speed. Builds into /tmp/cv_build_avx512emu (tools/dev_build.sh).
#
#   tools/avx512_emulated.sh                               tests/test_kernels.py tests/test_dispatch.py
#   tools/avx512_emulated.sh tests/test_engine.py -k greedy   any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/include/simde/x86/avx512.h ]; then
  echo "SIMDe headers not found (apt-get install libsimde-dev)" >&2
  exit 2
fi
rm -rf /tmp/cv_build_avx512emu/tmp /tmp/cv_build_avx512emu/lib/conveyor/_core*.so /tmp/cv_build_avx512emu/lib/conveyor/_testing*.so  # headers are untracked: rebuild (ccache keeps it quick)
lib=$(CONVEYOR_EMULATE_AVX512=1 CONVEYOR_CUDA=0 tools/dev_build.sh avx512emu)
[ $# -eq 0 ] && set -- tests/test_kernels.py tests/test_dispatch.py
PYTHONPATH=$lib exec ${PYTHON:-python} -m pytest -q "$@"
