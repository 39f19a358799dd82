"""Checkpoints people can open: DCP's `.metadata` in a whole checkpoint's step directory (for
torch's own tools, never read by the runtime) and `tm-slurm export` (tm_slurm/export.py)."""
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tm_slurm import checkpoints
from tm_slurm import export as ex
from tm_slurm.cli import build_parser
from tm_slurm.config import Layout
from tm_slurm.topology import Topology
from tm_slurm.worker import checkpoint as ck
from tm_slurm.worker.state import TrainState, digest, named

ONE = Topology(Layout(dp=1, pp=1))


class Wrapper(torch.nn.Module):
    """Names its model `module` as DDP does (the registered model is the wrapper)."""

    def __init__(self, m):
        super().__init__()
        self.module = m


def _net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


def _adamw(m, lr=0.01):
    """Two param groups (decayed weights, the rest without), as training scripts have them."""
    return torch.optim.AdamW([{"params": [m[0].weight, m[2].weight]},
                              {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "weight_decay": 0.0}],
                             lr=lr)


def _trained(seed=0) -> TrainState:
    m = _net(seed)
    opt = _adamw(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(2):
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return TrainState(Wrapper(m), opt, sched, {"seen": 10})


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a, b):
    """Equal state dicts, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_dcp_tools_open_a_whole_checkpoint(tmp_path):
    s = _trained()
    d = ck.save(tmp_path, 10, 0, ONE, s)
    assert (d / checkpoints.DCP_METADATA).stat().st_mode & 0o777 == 0o600
    fresh = Wrapper(_net(1))
    dcp.load({"model": fresh.state_dict()}, checkpoint_id=d)        # keys flatten to model.module.*
    assert _same(fresh.state_dict(), s.model.state_dict())
    every = {n: torch.zeros_like(t) for n, t in named(s)}           # the index's names, optimizer too
    dcp.load(every, checkpoint_id=d)
    assert _same(every, dict(named(s)))
    dcp_to_torch_save(d, tmp_path / "dcp.pt")
    assert _same(torch.load(tmp_path / "dcp.pt"), dict(named(s)))


def test_export_loads_into_the_plain_module_and_optimizer(tmp_path):
    s = _trained()
    ck.save(tmp_path / "job" / "checkpoints", 10, 0, ONE, s)
    step, d = ex.export(tmp_path / "job", tmp_path / "out.pt")         # a job directory: its newest
    assert step == 10 and d == checkpoints.step_dir(tmp_path / "job" / "checkpoints", 10)
    out = torch.load(tmp_path / "out.pt")
    assert out.keys() == {"step", "model", "optimizer", "scheduler", "extra", "registered"} and out["step"] == 10
    m = _net(1)
    m.load_state_dict(out["model"], strict=True)                       # DDP's `module.` stripped
    assert _same(m.state_dict(), s.model.module.state_dict())
    opt = _adamw(m, lr=0.5)
    opt.load_state_dict(out["optimizer"])
    assert _same(opt.state_dict(), s.optimizer.state_dict())
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    sched.load_state_dict(out["scheduler"])
    assert sched.state_dict() == s.scheduler.state_dict() and out["extra"] == {"seen": 10}


def test_the_command_exports_the_newest_whole_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    ck.save(root, 10, 0, ONE, _trained(0))
    ck.save(root, 20, 0, ONE, _trained(1))
    (checkpoints.step_dir(root, 20) / "pp0.tp0" / checkpoints.INDEX_SUM).unlink()     # partial
    (checkpoints.step_dir(root, 10) / "pp0.tp1").mkdir()          # a stray shard directory: no index
    r = subprocess.run([sys.executable, "-m", "tm_slurm", "export", str(root), str(tmp_path / "o.pt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step 10" in r.stdout and torch.load(tmp_path / "o.pt")["step"] == 10


def cli(argv):
    args = build_parser().parse_args(argv)
    return args.fn(args)


def test_a_corrupt_shard_fails_the_export(tmp_path, capsys):
    d = ck.save(tmp_path, 10, 0, ONE, _trained())
    f = d / "pp0.tp0" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-7] + b"garbage")
    assert cli(["export", str(d), str(tmp_path / "o.pt")]) != 0
    err = capsys.readouterr().err
    assert "tm-slurm export:" in err and "pp0.tp0" in err and "digest" in err
    assert not (tmp_path / "o.pt").exists()
    with pytest.raises(ex.ExportError):
        ex.read_checkpoint(d)
    assert cli(["export", str(tmp_path / "nothing"), str(tmp_path / "o.pt")]) != 0


PP = Topology(Layout(dp=2, pp=2))


def _stage(pp):
    torch.manual_seed(pp)
    m = torch.nn.Linear(4, 4)                  # the same names on both stages, other tensors
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return TrainState(m, opt)


def test_the_metadata_waits_for_every_shard_and_names_pipeline_stages(tmp_path):
    ck.save(tmp_path, 10, 0, PP, _stage(0))                      # stage 0's shard only
    d = checkpoints.step_dir(tmp_path, 10)
    assert not (d / checkpoints.DCP_METADATA).exists()
    ck.save(tmp_path, 10, 2, PP, _stage(1))                      # rank 2: stage 1, the last shard
    assert (d / checkpoints.DCP_METADATA).exists()
    dcp_to_torch_save(d, tmp_path / "dcp.pt")
    want = {f"pp{k}.{n}": t for k in (0, 1) for n, t in named(_stage(k))}
    assert _same(torch.load(tmp_path / "dcp.pt"), want)
    x = ex.read_checkpoint(d)
    assert x.step == 10 and _same(x.tensors, want) and len(x.stages) == 2
    ex.export(d, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    assert out.keys() == {"step", "stages"}
    for k, part in enumerate(out["stages"]):
        m = torch.nn.Linear(4, 4)
        m.load_state_dict(part["model"], strict=True)
        opt = torch.optim.AdamW(m.parameters())
        opt.load_state_dict(part["optimizer"])
        assert _same(m.state_dict(), _stage(k).model.state_dict())
        assert _same(opt.state_dict(), _stage(k).optimizer.state_dict())
    ck.save(tmp_path, 10, 0, PP, _stage(0))                      # a shard rewritten: it goes, then back
    assert (d / checkpoints.DCP_METADATA).exists()


def test_a_hostile_metadata_is_never_read(tmp_path):
    """Garbage or a pickle that would run code: the checkpoint is whole or not by its indexes,
    loads, and exports as before, and nothing unpickles the file."""
    s = _trained()
    d = ck.save(tmp_path, 10, 0, ONE, s)
    planted = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {planted}",)

    for hostile in (os.urandom(4096), pickle.dumps(Evil())):
        (d / checkpoints.DCP_METADATA).write_bytes(hostile)
        assert checkpoints.latest_valid(tmp_path, ONE)[0] == (10, d)
        fresh = _trained(5)
        assert ck.load(d, 0, ONE, fresh) == 10 and digest(fresh) == digest(s)
        ex.export(d, tmp_path / "out.pt")
        assert not planted.exists()
    (d / "pp0.tp0" / checkpoints.INDEX_SUM).unlink()
    assert checkpoints.latest_valid(tmp_path, ONE)[0] is None          # it makes nothing whole
    assert checkpoints.prune(tmp_path, ONE, keep=0) == []


def test_plain_tensors_differing_between_tp_shards_have_no_global_form(tmp_path):
    """Hand-rolled TP (plain tensors, another slice on each tp shard under one name): no
    `.metadata` (the indexes cannot tell it from replicated tensors) and the export refuses it;
    replicated plain tensors export as one."""
    tp = Topology(Layout(tp=2, pp=1, ranks_per_node=2))
    for r in (0, 1):
        ck.save(tmp_path, 10, r, tp, _stage(r))
        ck.save(tmp_path, 20, r, tp, _stage(0))
    for step in (10, 20):
        assert not (checkpoints.step_dir(tmp_path, step) / checkpoints.DCP_METADATA).exists()
    with pytest.raises(ex.ExportError, match="pp0.tp0 and pp0.tp1 hold different values"):
        ex.read_checkpoint(checkpoints.step_dir(tmp_path, 10))
    assert _same(ex.read_checkpoint(checkpoints.step_dir(tmp_path, 20)).tensors, dict(named(_stage(0))))


@pytest.mark.parametrize("layout", [Layout(dp=2, dp_shard=2, pp=1),
                                    Layout(dp=2, dp_shard=2, tp=2, pp=1, ranks_per_node=2)],
                         ids=["fsdp", "fsdp-x-tp"])
def test_a_sharded_checkpoint_exports_whole_tensors(tmp_path, layout):
    """FSDP2 (and FSDP2 x TP) DTensor pieces, uneven ones included, assembled into the tensors
    a plain module and optimizer take (tests/test_reshard.py writes it)."""
    from tests.test_reshard import Net, _run
    full = _run("save", layout, tmp_path)[0]          # rank 0's state, every tensor gathered
    d = checkpoints.step_dir(tmp_path, 20)
    want = {n: t for n, t in full.items() if isinstance(t, torch.Tensor)}
    assert _same(ex.read_checkpoint(d).tensors, want)
    if layout.tp == 1:
        dcp_to_torch_save(d, tmp_path / "dcp.pt")
        assert _same(torch.load(tmp_path / "dcp.pt"), want)
    else:
        assert not (d / checkpoints.DCP_METADATA).exists()
    ex.export(d, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    m = Net()
    m.load_state_dict(out["model"], strict=True)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    opt.load_state_dict(out["optimizer"])
    assert _same({f"model.{k}": t for k, t in m.state_dict().items()},
                 {n: t for n, t in want.items() if n.startswith("model.")})
    assert opt.param_groups[0]["lr"] == full["lr"] and out["extra"] == full["extra"]
    assert _same({f"opt.{i}.{k}": t for i, st in opt.state_dict()["state"].items() for k, t in st.items()},
                 {n: t for n, t in want.items() if n.startswith("opt.")})
