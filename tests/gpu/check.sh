#!/usr/bin/env bash
# The GPU check of issue 13, for a machine with one CUDA GPU (under 5 minutes). Prints one JSON
# object on stdout (the job runs' logs go to stderr); exit 1 if a part failed.
#
# Covered on one GPU:
#  - nccl_groups (tests/gpu/nccl_groups.py, run first, in its own process): real ProcessGroupNCCL
#    objects built by build_group with eager init (nonblocking), each build timed; used through a
#    GroupTable (allreduce, settle); aborted from another thread (abort_members, timed) and failing
#    through afterwards; replaced through the reconfiguration path (a new instance built after the
#    abort, swapped in, working). World size 1: NCCL takes one rank of a communicator per GPU.
#  - CUDA state through a node kill and its recovery (DP=1: resumed from the sharded checkpoint),
#    bit-identical to an undisturbed run, with a sandboxed and a cold standby;
#  - a standby parked on the GPU (its CUDA memory);
#  - the joiner's first compiled step, sandboxed vs cold.
# What a multi-GPU node would add: a real two-rank NCCL data link, so a planned swap's state
# transfer over NCCL; a survivor released by abort while its peer is dead inside a collective;
# phase 1's communicator creation concurrent with the training collectives on the same GPU.
#
# `tests/gpu/check.sh --cpu [--no-compile]` runs every part on CPU (what CI can check without a
# GPU): the groups part with backend "nccl-like" (gloo under NCCL's semantics), the job runs on gloo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" -m tests.gpu.check "$@"
