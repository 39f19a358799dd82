#!/bin/bash
# fail.sh NODE [MODE] -- make a minicluster node really fail. Prints
# "NODE MODE <epoch>", the instant of the failure. Undo with restore.sh NODE.
#   crash   (default) pull the cable, then SIGKILL every process of the node at once
#           (slurmd, slurmstepd, job tasks): a power loss. Peers get no FIN/RST;
#           their TCP connections just hang, as with a real dead machine.
#   kill    every process of the node is SIGKILLed, the link stays up (peers get RST)
#   netcut  network partition only: the cable is pulled, processes keep running
#   slurmd  SIGKILL slurmd only (daemon crash); running job steps continue
#   hang    SIGSTOP every process of the node (hung kernel, swapping machine)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[ $# -ge 1 ] || die "usage: fail.sh NODE [crash|kill|netcut|slurmd|hang]"
N=$1; MODE=${2:-crash}
ns=$(node_ns "$N")
[ -e "/run/netns/$ns" ] || die "unknown node '$N' (cluster in $DIR has node1..node$NODES)"
ipid=$(init_pid "$N")
now() { date +%s.%N; }
case $MODE in
  crash)  link_set "$N" down; T=$(now); [ -z "$ipid" ] || kill -KILL "$ipid" ;;
  kill)   T=$(now); [ -z "$ipid" ] || kill -KILL "$ipid" ;;
  netcut) link_set "$N" down; T=$(now) ;;
  slurmd) p=$(slurmd_pid "$N"); [ -n "$p" ] || die "no slurmd running on $N"
          T=$(now); kill -KILL "$p"
          # until nodeinit reaps it, the zombie still counts as "slurmd running", and a
          # restore.sh that came now would only signal the corpse
          for _ in $(seq 1 100); do [ -z "$(slurmd_pid "$N")" ] && break; sleep 0.05; done ;;
  hang)   T=$(now)
          for p in $(ip netns pids "$ns"); do kill -STOP "$p" 2>/dev/null || true; done ;;
  *) die "unknown mode '$MODE' (crash|kill|netcut|slurmd|hang)" ;;
esac
if [ "$MODE" = crash ] || [ "$MODE" = kill ]; then   # return once the kernel has killed them all
  for _ in $(seq 1 100); do [ -z "$(ip netns pids "$ns")" ] && break; sleep 0.05; done
fi
echo "$MODE $T" >"$RUN/pids/failed.$N"
echo "$N $MODE $T"
