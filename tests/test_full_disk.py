"""A full disk under the job directory (a real tmpfs of a few KiB, mounted here as root): the
event log, status and checkpoint writes never raise into the controller or the training loop,
leave no partial file, and say what was lost once space returns."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from tm_slurm import events as evlog
from tm_slurm.config import Layout
from tm_slurm.topology import Topology
from tm_slurm import checkpoints
from tm_slurm.worker import checkpoint as ckpt
from tm_slurm.worker.state import TrainState

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (./dev test runs as root)")


@pytest.fixture
def small_fs(tmp_path):
    d = tmp_path / "fs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=True)


def fill(d) -> int:
    fd, n = os.open(d / "filler", os.O_WRONLY | os.O_CREAT), 0
    try:
        while True:
            n += os.write(fd, b"\0" * 512)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return n


def test_events_are_counted_while_the_disk_is_full_and_reported_after(small_fs):
    log = evlog.EventLog(small_fs / "events.jsonl", "j")
    log.emit("job_start")
    fill(small_fs)
    for i in range(20):                                        # past the file's last page
        log.emit("step_done", step=i, pad="x" * 1000)          # counted, not raised
    lost = log.dropped
    assert lost >= 15
    with pytest.raises(OSError):
        evlog.fsync_write(small_fs / "status.json", b"{}" * 100000)
    assert sorted(p.name for p in small_fs.iterdir()) == ["events.jsonl", "filler"]   # no .tmp left
    (small_fs / "filler").unlink()
    log.emit("swap_done")
    recs = list(evlog.read(small_fs / "events.jsonl"))
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "job_start" and kinds[-2:] == ["swap_done", "events_dropped"]
    assert kinds.count("step_done") == 20 - lost                # whole lines, none torn
    assert recs[-1]["count"] == lost and recs[-1]["since"] is not None and log.dropped == 0
    assert recs[-1]["kinds"] == {"step_done": lost}              # what was lost, by kind
    log.close()


@pytest.mark.parametrize("pages_free", [0, 2])
def test_a_checkpoint_that_does_not_fit_leaves_nothing_of_its_shard(small_fs, pages_free):
    """Full before the write (an OSError from the first write) or in the middle of a tensor
    (torch's zip writer says only "unexpected pos"): both are a full disk, said as one."""
    state = TrainState(torch.nn.Linear(256, 256))              # 257 KiB of weights: does not fit
    t = Topology(Layout())
    if pages_free:
        n = fill(small_fs)
        os.truncate(small_fs / "filler", n - pages_free * 4096)
    with pytest.raises(OSError, match="No space left on device") as e:
        ckpt.save(small_fs / "ckpt", 10, 0, t, state)
    assert e.value.errno == errno.ENOSPC
    d = checkpoints.step_dir(small_fs / "ckpt", 10)
    assert list(d.iterdir()) == []
    assert checkpoints.latest_valid(small_fs / "ckpt", t)[0] is None
