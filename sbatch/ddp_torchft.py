"""The stock DDP example (ddp_example.py) written as a torchft job: what a user would pick instead
of tm_slurm. One process is one replica group (here of one rank); a Lighthouse decides who takes
part in each step; a replica that died is restarted by its supervisor and heals from a live peer
while the others train on without it. `tm-slurm bench --example ddp --strategies torchft` runs it
(needs `pip install -e .[peers]`):

    python sbatch/ddp_torchft.py --replica 0 --replicas 2 --lighthouse http://HOST:PORT --out DIR

Same model, data, seeds and checkpoint cadence as ddp_example.py. Writes to --out: the replica's
commits (`steps-r<R>.jsonl`: step, commit wall time, step-to-step seconds, participants) and its
final state's digest (`final-r<R>.json`), as the runtime digests a rank's state.
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from tm_slurm.data import SyntheticTokens, key
from tm_slurm.worker.state import TrainState, digest

from ddp_model import Net, options

p = options()
p.add_argument("--replica", type=int, required=True, help="this replica group's index (its DP rank)")
p.add_argument("--replicas", type=int, required=True)
p.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
p.add_argument("--out", required=True)
p.add_argument("--timeout", type=float, default=30.0, help="collective and commit timeout (s)")
p.add_argument("--checkpoint-every", type=int, default=0, help="replica 0 saves the state every N steps")
p.add_argument("--host", default="127.0.0.1", help="the address its peers reach this replica at")
p.add_argument("--start-file", help="wait for this file before the first step (all replicas in the first quorum)")
args = p.parse_args()
torch.set_num_threads(1)
out = Path(args.out)

torch.manual_seed(0)
model_ = Net(args.vocab, args.dim)
raw = torch.optim.AdamW(model_.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.LambdaLR(raw, lambda s: min(1.0, (s + 1) / 10))


def state_dict() -> dict:
    return {"model": model_.state_dict(), "optim": raw.state_dict(), "sched": sched.state_dict()}


def load_state_dict(sd: dict) -> None:
    model_.load_state_dict(sd["model"])
    raw.load_state_dict(sd["optim"])
    sched.load_state_dict(sd["sched"])


# a replica group's rank 0 hosts the group's store; the Manager finds its peers through the Lighthouse
store = TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
t = timedelta(seconds=args.timeout)
manager = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=load_state_dict, state_dict=state_dict,
                  min_replica_size=1, use_async_quorum=True, timeout=t, quorum_timeout=t,
                  connect_timeout=t, rank=0, world_size=1, store_addr=args.host, store_port=store.port,
                  lighthouse_addr=args.lighthouse, replica_id=f"replica{args.replica}",
                  hostname=args.host)
model = DistributedDataParallel(manager, model_)
opt = Optimizer(manager, raw)
data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1)
log = open(out / f"steps-r{args.replica}.jsonl", "a", buffering=1)
(out / f"ready-r{args.replica}").touch()               # heartbeating: the Lighthouse counts it
if args.start_file:
    while not os.path.exists(args.start_file):
        time.sleep(0.02)

t_prev = time.time()
while (step := manager.current_step()) < args.steps:
    torch.manual_seed(key(0, step, args.replica))          # as the runtime seeds a rank's step
    opt.zero_grad(set_to_none=True)                        # starts the step's quorum
    x, y = data.batch(step, args.replica)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()                                             # the optimizer steps only if committed
    now = time.time()
    if (done := manager.current_step() - 1) >= step:     # committed (a replica that healed: a later step)
        sched.step()
        if args.checkpoint_every and args.replica == 0 and (done + 1) % args.checkpoint_every == 0:
            torch.save(state_dict(), out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", out / "checkpoint.pt")
        log.write(json.dumps({"step": done, "wall": now, "dur_s": now - t_prev,
                              "participants": manager.num_participants()}) + "\n")
    t_prev = now
    if args.sleep:
        time.sleep(args.sleep)

(out / f"final-r{args.replica}.json").write_text(json.dumps(
    {"replica": args.replica, "step": manager.current_step(),
     "digest": digest(TrainState(model, raw, sched))}))
manager.shutdown(wait=False)
