"""State transfer as raw tensors between two real processes over a real gloo group."""
import multiprocessing as mp

import torch

from tm_slurm.control.auth import AuthError, Keys, Sealer
from tm_slurm.messages import GroupBuild
from tm_slurm.store.client import StoreClient
from tm_slurm.worker.state import Rollback, TrainState, digest, manifest, nbytes, recv_state, send_state

from .stores import Served

KEYS = Keys.derive(b"s" * 32)


def make(seed, warm):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    if warm:
        for i in range(3):
            m(torch.randn(8, 16)).pow(2).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    return TrainState(m, opt, sched, extra={"tokens_seen": 123 if warm else 0})


def _peer(rank, port, q, receiver_warm, sender_secret=b"s" * 32):
    # a forked child must not enter the OpenMP pool its parent may have started (an earlier test's
    # training): GNU OpenMP does not survive fork, and the child would hang in its first kernel
    torch.set_num_threads(1)
    from tm_slurm.comm.groups import build_group
    store = StoreClient("127.0.0.1", port, KEYS.store, 30.0)
    g = build_group(store, GroupBuild("xfer", (0, 1), "t/xfer"), rank, device=torch.device("cpu"),
                    backend="gloo", timeout=30, iface="127.0.0.1")
    if rank == 0:
        st = make(0, warm=True)
        try:
            info = send_state(g.pg, st, 42, Sealer(Keys.derive(sender_secret), "j", "w0"), peer=1)
        except RuntimeError as e:        # the receiver refused the manifest and left
            info = str(e)
        q.put(("sent", digest(st), info))
    else:
        st = make(1, warm=receiver_warm)
        ptrs = [t.data_ptr() for t in [p.data for p in st.model.parameters()]]
        before = digest(st)
        try:
            step, info = recv_state(g.pg, st, Sealer(KEYS, "j", "w1"), peer=0)
        except AuthError as e:
            q.put(("got", digest(st) == before, str(e)))
            return
        same_storage = ptrs == [p.data.data_ptr() for p in st.model.parameters()]
        q.put(("got", digest(st), step, same_storage, st.extra))


def _run(receiver_warm, sender_secret=b"s" * 32):
    served = Served(KEYS.store)
    ctx = mp.get_context("fork")   # torch is already imported here: no second import
    q = ctx.Queue()
    ps = [ctx.Process(target=_peer, args=(r, served.port, q, receiver_warm, sender_secret)) for r in (0, 1)]
    for p in ps:
        p.start()
    try:
        res = {x[0]: x for x in (q.get(timeout=120), q.get(timeout=120))}
    finally:
        for p in ps:
            p.join(30)
            if p.exitcode is None:
                p.kill()
        served.close()
    return res


def test_transfer_into_a_cold_receiver_is_bit_identical():
    res = _run(receiver_warm=False)
    assert res["sent"][1] == res["got"][1]
    assert res["got"][2] == 42 and res["got"][4] == {"tokens_seen": 123}
    assert res["sent"][2]["bytes"] > 0


def test_transfer_into_a_warm_receiver_reuses_its_tensors():
    res = _run(receiver_warm=True)
    assert res["sent"][1] == res["got"][1] and res["got"][3] is True


def test_a_manifest_not_sealed_with_the_job_secret_is_refused_before_anything_is_applied():
    res = _run(receiver_warm=True, sender_secret=b"x" * 32)
    assert res["got"][1] is True and "bad MAC" in res["got"][2]


def test_digest_sees_every_bit():
    a, b = make(0, True), make(0, True)
    assert digest(a) == digest(b)
    with torch.no_grad():
        p = next(a.model.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1e9))
    assert digest(a) != digest(b)
    b.optimizer.param_groups[0]["lr"] *= 2
    assert digest(make(0, True)) != digest(b)
    assert nbytes(a) > 0 and manifest(a, 3).step == 3


def test_a_discarded_step_leaves_no_trace_in_buffers_or_registered_state():
    class Seen:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    seen = Seen()
    r = Rollback(TrainState(net, registered={"seen": seen}))
    net(torch.randn(4, 1, 5, 5))                 # a committed step: its updates stay
    seen.n = 1
    r.take()
    kept = {k: v.clone() for k, v in net.state_dict().items()}
    net(torch.randn(4, 1, 5, 5))                 # the discarded step's forward
    seen.n = 2
    assert not torch.equal(net[1].running_mean, kept["1.running_mean"])
    r.restore()
    assert all(torch.equal(v, kept[k]) for k, v in net.state_dict().items())
    assert seen.n == 1 and net[1].num_batches_tracked.item() == 1
