import torch

from tm_slurm.config import Layout
from tm_slurm.topology import Topology
from tm_slurm import checkpoints
from tm_slurm.worker import checkpoint as ck
from tm_slurm.worker.state import TrainState, digest

T = Topology(Layout(dp=2, pp=2))


def state(seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return TrainState(m, opt)


def save_all(root, step, seed):
    for r in range(T.world):
        ck.save(root, step, r, T, state(seed + T.coord(r).pp))


def test_only_dp0_writes_and_load_round_trips(tmp_path):
    assert ck.save(tmp_path, 10, 1, T, state(0)) is None       # rank 1 is dp 1
    save_all(tmp_path, 10, 0)
    d = checkpoints.step_dir(tmp_path, 10)
    assert sorted(p.name for p in d.iterdir()) == [checkpoints.DCP_METADATA, "pp0.tp0", "pp1.tp0"]
    assert sorted(p.name for p in (d / "pp0.tp0").iterdir()) == ["__0_0.distcp", checkpoints.INDEX, checkpoints.INDEX_SUM]
    fresh = state(99)
    assert ck.load(d, 3, T, fresh) == 10                      # rank 3: stage 1
    assert digest(fresh) == digest(state(1))


def test_corrupt_or_partial_checkpoint_is_rejected(tmp_path):
    save_all(tmp_path, 10, 0)
    save_all(tmp_path, 20, 0)
    save_all(tmp_path, 30, 0)
    p = checkpoints.step_dir(tmp_path, 30) / "pp1.tp0" / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:-7] + b"garbage")               # corrupt
    (checkpoints.step_dir(tmp_path, 20) / "pp0.tp0" / checkpoints.INDEX_SUM).unlink()   # partial
    found, rejected = checkpoints.latest_valid(tmp_path, T)
    assert found[0] == 10
    assert [s for s, _ in rejected] == [30, 20] and "pp1.tp0" in rejected[0][1]


def test_prune_keeps_newest_valid(tmp_path):
    for s in (10, 20, 30):
        save_all(tmp_path, s, 0)
    assert checkpoints.prune(tmp_path, T, keep=2) == [10]
    assert [s for s, _ in checkpoints.candidates(tmp_path)] == [30, 20]


def test_explicit_writer(tmp_path):
    assert ck.save(tmp_path, 5, 1, T, state(0), writer=True) is not None
    assert ck.save(tmp_path, 5, 0, T, state(0), writer=False) is None


def test_async_write_and_a_planted_pickle_index(tmp_path):
    """The background write saves the state as it was when staged; an index that is a pickle
    (DCP's own format), even with a matching digest, is no checkpoint and is never unpickled."""
    import hashlib
    import pickle

    s = state(0)
    want = digest(s)
    fut = ck.Writer().submit(tmp_path, 10, 0, Topology(Layout(dp=1, pp=1)), s)
    with torch.no_grad():                       # training goes on while it writes
        for p in s.model.parameters():
            p.add_(1.0)
    fut.result()
    one = Topology(Layout(dp=1, pp=1))
    fresh = state(7)
    assert ck.load(checkpoints.step_dir(tmp_path, 10), 0, one, fresh) == 10 and digest(fresh) == want
    sd = checkpoints.step_dir(tmp_path, 10) / "pp0.tp0"
    evil = pickle.dumps({"step": 10})
    (sd / checkpoints.INDEX).write_bytes(evil)
    (sd / checkpoints.INDEX_SUM).write_text(hashlib.sha256(evil).hexdigest())
    assert checkpoints.latest_valid(tmp_path, one)[0] is None
