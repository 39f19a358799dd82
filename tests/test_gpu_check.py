"""The NCCL groups part of tests/gpu/check.sh, in CPU mode (backend "nccl-like"), in this process:
the harness a GPU machine runs, checked where there is none. The job runs of check.sh take
minutes and are not run here (`tests/gpu/check.sh --cpu --no-compile` runs them)."""
from __future__ import annotations

from tests.gpu.nccl_groups import FLAGS, GID, run


def test_the_gpu_checks_groups_part_builds_uses_aborts_and_replaces_nccl_like_groups_on_cpu():
    r = run("nccl-like", timeout=20)
    assert "error" not in r, r
    assert {k: r[k] for k in FLAGS} == {k: True for k in FLAGS}, r
    assert r["ok"] and r["kind"] == "nccl-like", r
    assert len(r["build_s"]) == 2 and r["abort_s"] is not None, r
    # after the abort: the aborted instance fails through, the rebuilt one works
    assert r["step3"]["allreduce"] is False and r["step3"]["broken"] == [GID], r
    assert r["step4"] == {"allreduce": True, "values_right": True, "broken": []}, r
    assert r["direct_op_after_abort"].startswith("refused"), r      # NcclLikeGroup raises at once
