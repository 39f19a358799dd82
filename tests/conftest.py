"""Shared fixtures. `reference`: the digests of an undisturbed run of the example job (the
bar every interrupted run is held to), memoised per layout and length, run unpaced."""
from __future__ import annotations

import pytest

from .jobs import run_job
from .stores import Served

_refs: dict = {}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Digests of an undisturbed run of the same job (memoised per layout and length)."""
    def get(steps: int, layout=("--dp", "2", "--pp", "2"), active: int = 4, script_args=(), script=None):
        key = (steps, tuple(layout), active, tuple(script_args), script)
        if key not in _refs:
            ran = run_job(tmp_path_factory.mktemp("ref"), f"{active}+0", steps, sets=["standby.count=0"],
                          layout=layout, script_args=script_args, script=script, paced=False)
            assert ran.rc == 0, f"reference run failed: {ran.job_dir}"
            _refs[key] = ran.result["digests"]
        return _refs[key]
    return get


@pytest.fixture
def served():
    """The job's store, served by its own process; its clients come from `served.client()`."""
    s = Served()
    yield s
    s.close()
