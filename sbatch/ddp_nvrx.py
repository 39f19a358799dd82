"""The stock DDP example (ddp_example.py) as a plain torchrun-style job that checkpoints and resumes,
run by NVIDIA's `ft_launcher` (nvidia-resiliency-ext): when a rank fails, the launcher restarts
every worker in place and they resume from the last checkpoint. `tm-slurm bench --example ddp
--strategies nvrx` runs it (needs `pip install -e .[peers]`):

    ft_launcher --standalone --nproc-per-node 2 --max-restarts 3 sbatch/ddp_nvrx.py --out DIR

Same model, data, seeds and checkpoint cadence as ddp_example.py. Writes to --out: rank r's
commits (`steps-r<r>.jsonl`: step, commit wall time, step-to-step seconds, the launcher's restart
count), its pid (`pid-r<r>`, for the bench to interrupt it) and its final state's digest
(`final-r<r>.json`).
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tm_slurm.data import SyntheticTokens, key
from tm_slurm.worker.state import TrainState, digest

from ddp_model import Net, options

p = options()
p.add_argument("--out", required=True)
p.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s)")
p.add_argument("--checkpoint-every", type=int, default=0, help="rank 0 saves the state every N steps")
args = p.parse_args()
torch.set_num_threads(1)
out = Path(args.out)

dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
(out / f"pid-r{rank}").write_text(str(os.getpid()))
torch.manual_seed(0)
model = DDP(Net(args.vocab, args.dim))
raw = torch.optim.AdamW(model.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.LambdaLR(raw, lambda s: min(1.0, (s + 1) / 10))
data = SyntheticTokens(args.vocab, args.seq, args.batch, seed=1)

start, ckpt = 0, out / "checkpoint.pt"
if ckpt.exists():                      # written by this job's rank 0 (weights_only: plain data only)
    sd = torch.load(ckpt, weights_only=True)
    model.module.load_state_dict(sd["model"])
    raw.load_state_dict(sd["optim"])
    sched.load_state_dict(sd["sched"])
    start = sd["step"] + 1

log = open(out / f"steps-r{rank}.jsonl", "a", buffering=1)
t_prev = time.time()
for step in range(start, args.steps):
    torch.manual_seed(key(0, step, rank))                   # as the runtime seeds a rank's step
    x, y = data.batch(step, rank)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    raw.zero_grad(set_to_none=True)
    loss.backward()
    raw.step()
    sched.step()
    now = time.time()
    log.write(json.dumps({"step": step, "wall": now, "dur_s": now - t_prev, "attempt": attempt}) + "\n")
    t_prev = now
    if args.checkpoint_every and rank == 0 and (step + 1) % args.checkpoint_every == 0:
        torch.save({"model": model.module.state_dict(), "optim": raw.state_dict(), "sched": sched.state_dict(),
                    "step": step}, out / "checkpoint.tmp")
        os.replace(out / "checkpoint.tmp", ckpt)
    if args.sleep:
        time.sleep(args.sleep)

(out / f"final-r{rank}.json").write_text(json.dumps({"rank": rank, "digest": digest(TrainState(model, raw, sched))}))
dist.destroy_process_group()
