#!/usr/bin/env bash
# Development only: builds conveyor._core and conveyor._testing into a private folder so that several
# people (or agents) can build in one checkout without clobbering each other.
# Usage: PYTHONPATH=$(tools/dev_build.sh NAME) python -m pytest tests/...
set -euo pipefail
name=${1:-dev}
out=/tmp/cv_build_$name
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
"$py" setup.py -q build_ext --build-lib "$out/lib" --build-temp "$out/tmp" >&2
mkdir -p "$out/lib/conveyor"
for f in python/conveyor/*; do
  case "$f" in *.so|*__pycache__*) continue ;; esac
  ln -sfn "$(realpath "$f")" "$out/lib/conveyor/$(basename "$f")"
done
echo "$out/lib"
