#!/bin/bash
# down.sh [--quiet] [--purge] -- stop the minicluster and remove everything up.sh
# created: processes, network namespaces, generated state and wrappers. Idempotent.
# The logs are kept in $DIR/last-logs; --purge removes them too.
# Only processes inside our own namespaces or recorded in $RUN/pids are touched.
set -uo pipefail   # no -e: tear down as much as possible, report at the end
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
QUIET=; PURGE=
for a in "$@"; do
  case $a in --quiet) QUIET=1 ;; --purge) PURGE=1 ;; *) die "usage: down.sh [--quiet] [--purge]" ;; esac
done
say() { [ -n "$QUIET" ] || log "$@"; }
[ "$(id -u)" = 0 ] || die "must run as root"

alive() { local p; for p in "$@"; do [ -d "/proc/$p" ] && return 0; done; return 1; }

# 0. job ids go on where they stopped at the next up (FirstJobId): a job directory keyed by
#    the id (tm_slurm_jobs/<id>) must never be taken over by a later job
next=$(timeout 5 "$BIN/scontrol" show config 2>/dev/null | awk '$1 == "NEXT_JOB_ID" {print $3}')
[[ "$next" =~ ^[0-9]+$ ]] && echo "$next" >"$DIR/next-job-id"

# 1. SIGTERM to every machine's PID 1 (slurmctld saves its state, the daemons log
#    their exit) and to munged, all at once; SIGKILL whatever is left after 3 s.
#    Everything is discarded anyway, and a slurmd that lost its network can take
#    10 s and more to stop. A hung node is SIGSTOPped: wake it first.
for ns in $(cluster_ns); do
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; done
done
stopping=()
for f in "$RUN"/pids/init.*.pid; do
  [ -e "$f" ] || continue
  n=${f##*/init.}; p=$(init_pid "${n%.pid}")
  [ -n "$p" ] && kill -TERM "$p" 2>/dev/null && stopping+=("$p")
done
p=$(cat "$RUN/pids/munged.pid" 2>/dev/null)
# only if the recorded pid really is our munged
if [ -n "$p" ] && tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "--socket=$RUN/run/munge.socket"; then
  kill -TERM "$p" && stopping+=("$p")
fi
for _ in $(seq 1 30); do alive "${stopping[@]}" || break; sleep 0.1; done
for p in "${stopping[@]}"; do kill -KILL "$p" 2>/dev/null; done

# 2. whatever still runs in our namespaces: clients run through the wrappers,
#    and commands run "on" a node
for ns in $(cluster_ns); do
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
done
# the `unshare` parents exit right after their child
for f in "$RUN"/pids/unshare.*.pid; do
  [ -e "$f" ] || continue
  p=$(cat "$f"); for _ in $(seq 1 20); do alive "$p" || break; sleep 0.05; done
done

# 4. network namespaces (deleting one also deletes its veth ends and the bridge)
for ns in $(cluster_ns); do
  for _ in 1 2 3 4 5; do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.2; done
  ip netns del "$ns" 2>/dev/null || say "could not delete netns $ns"
done

# 5. generated state
if [ -d "$RUN/log" ] && [ -z "$PURGE" ]; then
  rm -rf "$DIR/last-logs" && mv "$RUN/log" "$DIR/last-logs"
fi
rm -rf "$RUN" "$BIN"
[ -z "$PURGE" ] || { rm -rf "$DIR/last-logs" "$DIR/next-job-id"; rmdir "$DIR" 2>/dev/null; }

left=$(cluster_ns)
[ -z "$left" ] || die "namespaces left: $(echo $left)"
say "minicluster down"
