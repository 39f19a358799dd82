"""Tests against the real minicluster (`tm-slurm minicluster`), all marked `slurm`.

The session brings one 5-node cluster up on first use and down at the end. A cluster
that cannot start fails the tests that need it, it never skips them: CI always runs
this directory, and a silently skipped cluster test is a test nobody runs. Needs root.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tm_slurm.minicluster import MiniCluster, MiniClusterError

NODES = 6   # 4 active + 1 standby for the example job, and one free node (a companion standby)
HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m slurm` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slurm)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """`item.call_failed`, for fixtures that keep a failed test's evidence."""
    rep = (yield).get_result()
    if rep.when == "call" and rep.failed:
        item.call_failed = True


@pytest.fixture(scope="session")
def minicluster():
    mc = MiniCluster()
    try:
        took = mc.up(nodes=NODES)
    except MiniClusterError as e:
        error = str(e)
    else:
        error = None
    if error:
        pytest.fail(f"the minicluster could not start: {error}", pytrace=False)
    print(f"\n[minicluster] up in {took:.2f} s ({mc.run_dir})")
    yield mc
    print(f"\n[minicluster] down in {mc.down():.2f} s")


@pytest.fixture
def healthy_cluster(minicluster):
    """The session cluster with every node IDLE and no job left over."""
    minicluster.heal()
    return minicluster


@pytest.fixture(autouse=True)
def _leave_cluster_usable(request):
    """Whatever a test did to the cluster (failed nodes, drains, jobs), the next test
    gets a working one."""
    yield
    if "minicluster" in request.fixturenames:
        request.getfixturevalue("minicluster").heal()
