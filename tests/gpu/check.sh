#!/usr/bin/env bash
# The GPU check of issue 13, for a machine with one CUDA GPU (under 5 minutes): CUDA state through
# a node kill and its recovery, a standby parked on the GPU (its memory), and the joiner's first
# compiled step, sandboxed vs cold. `tests/gpu/check.sh --cpu --no-compile` runs the same harness
# on CPU (what CI can check without a GPU). Prints one JSON object; exit 1 if a run was not
# bit-identical to its undisturbed reference.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" -m tests.gpu.check "$@"
