# shellcheck shell=bash
# Settings and helpers shared by the minicluster scripts (sourced, not run).
#
# Settings come from TM_SLURM_MINICLUSTER_* environment variables. up.sh saves the
# effective values in $RUN/settings.env; every other script sources that file, so
# fail/restore/down always act on the cluster that is really running, whatever the
# caller's environment says now.
MC_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${TM_SLURM_MINICLUSTER_DIR:-/var/tmp/tm-slurm-minicluster}
RUN=$DIR/cluster          # config, logs, spool, pids; removed by down.sh
BIN=$DIR/bin              # generated client wrappers
if [ -z "${MC_IGNORE_SAVED:-}" ] && [ -r "$RUN/settings.env" ]; then
  # shellcheck disable=SC1091
  . "$RUN/settings.env"
fi
NODES=${TM_SLURM_MINICLUSTER_NODES:-5}
PREFIX=${TM_SLURM_MINICLUSTER_PREFIX:-tmslurm}     # netns names: $PREFIX-head, $PREFIX-nodeK
SUBNET=${TM_SLURM_MINICLUSTER_SUBNET:-10.198.0}    # a /24 that exists only inside our namespaces
NODE_CPUS=${TM_SLURM_MINICLUSTER_CPUS:-2}
NODE_MEM=${TM_SLURM_MINICLUSTER_MEM:-1000}         # MB advertised per node
SLURMD_TIMEOUT=${TM_SLURM_MINICLUSTER_SLURMD_TIMEOUT:-10}
MSG_TIMEOUT=${TM_SLURM_MINICLUSTER_MESSAGE_TIMEOUT:-5}
REBOOT_DELAY=${TM_SLURM_MINICLUSTER_REBOOT_DELAY:-2}   # simulated "BIOS" time of a reboot
CGROUP_PLUGIN=${TM_SLURM_MINICLUSTER_CGROUP_PLUGIN:-cgroup/v1}
# nodeinit.py needs only the standard library; the system python is not affected
# by whatever venv the caller has active.
PYTHON=${TM_SLURM_MINICLUSTER_PYTHON:-$(command -v /usr/bin/python3 || command -v python3 || true)}
HEAD_NS=$PREFIX-head
HEAD_IP=$SUBNET.1
BRIDGE=${PREFIX:0:11}-br  # lives in the head netns; distinct name anyway, for readable `ip` output

log() { printf '[%s] %s\n' "$(date +%T.%3N)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

node_ns()   { echo "$PREFIX-$1"; }
node_ip()   { echo "$SUBNET.$((10 + ${1#node}))"; }
node_list() { local i; for i in $(seq 1 "$NODES"); do echo "node$i"; done; }

# Our network namespaces, including leftovers of an earlier run with more nodes.
cluster_ns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(head|node[0-9]+)$" || true; }

# Root-namespace pid of the nodeinit.py (PID 1) of a node or of the head; empty if
# not running. The cmdline check guards against a recycled pid.
init_pid() {
  local f=$RUN/pids/init.$1.pid p
  [ -r "$f" ] || return 0
  p=$(cat "$f")
  [ -n "$p" ] && grep -qF "nodeinit.py" "/proc/$p/cmdline" 2>/dev/null && echo "$p"
  return 0
}

# Root-namespace pid of the slurmd of a node; empty if none.
slurmd_pid() {
  local ipid; ipid=$(init_pid "$1")
  [ -z "$ipid" ] || pgrep -P "$ipid" -x slurmd | head -n1 || true
}

# A Slurm client run inside the head netns, where slurmctld is reachable.
sl() { SLURM_CONF=$RUN/etc/slurm/slurm.conf nsenter --net="/run/netns/$HEAD_NS" -- "$@"; }

# slurmctld's view of a node: IDLE, MIXED+DRAIN, DOWN+NOT_RESPONDING, ...
# (not sinfo's %T: it shows "mixed*" for a node that is already DOWN while it
#  still holds CPUs of a step killed by the failure)
node_state() { sl scontrol show node "$1" -o 2>/dev/null | grep -oE '(^| )State=[^ ]+' | head -n1 | sed 's/.*State=//'; }

# Both ends of a node's "cable".
link_set() {
  ip -n "$HEAD_NS" link set "v-$1" "$2" 2>/dev/null || true
  ip -n "$(node_ns "$1")" link set eth0 "$2" 2>/dev/null || true
}

# Daemons and nodes start from a clean environment: nothing of the caller's (venv,
# SLURM_CONF of another cluster, proxies) leaks into slurmd. Jobs do not inherit
# this: slurmd gives each job the environment of its submitter.
CLEAN_ENV=(env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
           HOME=/root LANG=C.UTF-8 TM_SLURM_MINICLUSTER_REBOOT_DELAY="$REBOOT_DELAY")

# start_machine ROLE NAME NETNS: boot one simulated machine; its PID 1 is nodeinit.py.
start_machine() {
  local role=$1 name=$2 ns=$3 upid ipid= i
  mkdir -p "$RUN/spool/$name"
  # nsenter, not `ip netns exec`: the latter remounts /sys, which hides
  # /sys/fs/cgroup, and slurmd 22.05 then refuses to start.
  setsid "${CLEAN_ENV[@]}" nsenter --net="/run/netns/$ns" -- \
    unshare --uts --ipc --mount --pid --fork --mount-proc --propagation private \
    "$PYTHON" "$MC_LIB/nodeinit.py" "$role" "$name" "$RUN" \
    </dev/null >>"$RUN/log/init.$name.out" 2>&1 &
  upid=$!
  for i in $(seq 1 200); do
    ipid=$(pgrep -P "$upid" | head -n1 || true)
    [ -n "$ipid" ] && grep -qF nodeinit.py "/proc/$ipid/cmdline" 2>/dev/null && break
    ipid=; sleep 0.02
  done
  [ -n "$ipid" ] || die "could not start $name (see $RUN/log/init.$name.out)"
  echo "$upid" >"$RUN/pids/unshare.$name.pid"
  echo "$ipid" >"$RUN/pids/init.$name.pid"
}
