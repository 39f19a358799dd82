#!/bin/bash
# Regenerates the golden Slurm 22.05 samples in this directory from a live cluster.
# Usage (root, slurmlab): . /tmp/slab/cluster/activate && tests/data/slurm/capture.sh
# Uses node2..node5; restores every node, reservation and job it touches.
set -u
cd "$(dirname "$0")"
J1= J2=
cleanup() {
  scontrol delete reservation=tm_golden_maint 2>/dev/null
  scontrol delete reservation=tm_golden_active 2>/dev/null
  scontrol cancel_reboot node5 2>/dev/null
  for n in node2 node4 node5; do
    scontrol show node -o $n | grep -q ' State=[A-Z_]*+[A-Z_+]*\(DRAIN\|FAIL\)' && scontrol update NodeName=$n State=RESUME
  done
  [ -n "$J1" ] && scancel $J1; [ -n "$J2" ] && scancel $J2
}
trap cleanup EXIT
wait_running() { for _ in $(seq 1 40); do [ "$(squeue -h -j $1 -o %T)" = RUNNING ] && return 0; sleep 0.25; done; return 1; }

sinfo --version > sinfo_version.txt
scontrol show config > scontrol_config.txt
# the allocation environment of an salloc command and of an sbatch batch step (SLURM_* only)
salloc -Q -N2 -w node[1-2] -t 1 env 2>/dev/null | grep '^SLURM' | sort > env_salloc.txt
sbatch --wait -Q -N2 -w node[1-2] -t 1 -D /tmp -o "$PWD/env_sbatch.txt" --wrap 'env | grep ^SLURM | sort' >/dev/null
scontrol show res -o > scontrol_res_none.txt
# routes the controller's address is chosen from: the submit host to node1; on node1 (an salloc
# step) to itself and to node2; node1's NodeAddr (the submit host may not resolve node names)
addr() { scontrol show node -o "$1" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2; }
ip -o route get "$(addr node1)" > ip_route_submit_to_node1.txt
srun -Q -N1 -n1 -w node1 ip -o route get "$(addr node1)" > ip_route_node1_to_node1.txt
srun -Q -N1 -n1 -w node1 ip -o route get "$(addr node2)" > ip_route_node1_to_node2.txt
J1=$(sbatch --parsable -N3 -w node[3-5] --no-kill --requeue -t 10 -J tm_golden -D /tmp -o /dev/null --wrap "sleep 300")
J2=$(sbatch --parsable -H -N2 -t 5 -J tm_golden_pending -D /tmp -o /dev/null --wrap "sleep 1")
wait_running $J1 || { echo "job $J1 did not start"; exit 1; }

# 1: node4 drained while the job runs there, node5 reboot ASAP requested
scontrol update NodeName=node4 State=DRAIN Reason="tm golden drain"
scontrol reboot ASAP nextstate=resume reason="tm golden reboot" node5
scontrol create reservation reservationname=tm_golden_maint nodes=node5 flags=maint,ignore_jobs \
    starttime=now+5minutes duration=30 users=root >/dev/null
sleep 0.3
sinfo --json > sinfo_drain_reboot.json
scontrol show node -o > scontrol_node_drain_reboot.txt
scontrol show res -o > scontrol_res_maint.txt
SLURM_TIME_FORMAT=%s scontrol show res -o > scontrol_res_maint_epoch.txt
scontrol show job -o $J1 > scontrol_job_running.txt
SLURM_TIME_FORMAT=%s scontrol show job -o $J1 > scontrol_job_running_epoch.txt
scontrol show job -o $J2 > scontrol_job_pending.txt

# 2: node2 drained while idle (IDLE+DRAIN), node5 FAIL with the job on it, node3 in an active MAINT window
scontrol cancel_reboot node5
scontrol update NodeName=node4 State=RESUME
scontrol update NodeName=node2 State=DRAIN Reason="tm golden idle drain"
scontrol update NodeName=node5 State=FAIL Reason="tm golden fail"
scontrol create reservation reservationname=tm_golden_active nodes=node3 flags=maint,ignore_jobs \
    starttime=now duration=10 users=root >/dev/null
for _ in $(seq 1 40); do scontrol show node -o node3 | grep -q MAINTENANCE && break; sleep 0.25; done
sinfo --json > sinfo_idle_drain_fail_maint.json
scontrol show node -o > scontrol_node_idle_drain_fail_maint.txt
SLURM_TIME_FORMAT=%s scontrol show res -o > scontrol_res_two_epoch.txt
echo "captured with job $J1 (running) and $J2 (held)"
