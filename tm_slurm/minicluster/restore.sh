#!/bin/bash
# restore.sh NODE [--wait] [--natural] -- undo fail.sh: SIGCONT a hung node, plug the
# cable back in, start slurmd again, or boot a crashed node (with a new boot time).
# With ReturnToService=2 slurmctld puts the node back in service once slurmd registers.
# A slurmd that survived (netcut, hang) registers again only when slurmctld next pings
# it (18-36 s), so by default it gets a SIGHUP, which makes it register at once
# (--natural: don't). --wait blocks until slurmctld has the node back (at most 60 s).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[ $# -ge 1 ] || die "usage: restore.sh NODE [--wait] [--natural]"
N=$1; shift; WAITUP=; NATURAL=; STARTED=
for a in "$@"; do
  case $a in --wait) WAITUP=1 ;; --natural) NATURAL=1 ;; *) die "unknown option '$a'" ;; esac
done
ns=$(node_ns "$N")
[ -e "/run/netns/$ns" ] || die "unknown node '$N' (cluster in $DIR has node1..node$NODES)"
for p in $(ip netns pids "$ns"); do kill -CONT "$p" 2>/dev/null || true; done
link_set "$N" up
ipid=$(init_pid "$N"); spid=$(slurmd_pid "$N")
if [ -z "$ipid" ]; then
  start_machine node "$N" "$ns"
elif [ -z "$spid" ]; then
  kill -HUP "$ipid"          # nodeinit: start slurmd
  STARTED=1
elif [ -z "$NATURAL" ]; then
  kill -HUP "$spid"          # slurmd: reconfigure, which registers with slurmctld now
fi
rm -f "$RUN/pids/failed.$N"
[ -n "$WAITUP" ] || exit 0
# slurmctld may not have noticed a killed slurmd yet (the node still looks IDLE): wait
# for the new one to listen, or the next srun to the node fails to connect
if [ -n "$STARTED" ]; then
  for _ in $(seq 1 300); do
    [ -n "$(ip netns exec "$ns" ss -Hltn 'sport = :6818' 2>/dev/null)" ] && break
    sleep 0.1
  done
fi
s=
for _ in $(seq 1 600); do
  s=$(node_state "$N")
  [ -n "$s" ] && [[ $s != *DOWN* && $s != *NOT_RESPONDING* ]] && { log "$N is $s"; exit 0; }
  sleep 0.1
done
die "$N still ${s:-unknown} 60 s after restore (see $RUN/log/slurmd.$N.log)"
