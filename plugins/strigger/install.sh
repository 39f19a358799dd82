#!/bin/bash
# Set the permanent Slurm node triggers that run tm-slurm-trigger, then list them.
# Run as root or SlurmUser (a trigger's program runs as whoever set it, and tm_slurm jobs accept
# request files only from their user, root or SlurmUser). Settings (environment):
#   TM_SLURM=/path/to/tm-slurm   the entry point (default: `command -v tm-slurm`); slurmctld's
#                                environment is not yours, so it is baked into the trigger
#   TM_SLURM_TRIGGER_LOG=FILE    where the program logs (default /var/log/slurm/tm-slurm-trigger.log)
#   TM_SLURM_TRIGGER_EVENTS="fail down"   which node events
# Remove with: strigger --clear --id=ID (IDs from `strigger --get`).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
program=$here/tm-slurm-trigger
tm=${TM_SLURM:-$(command -v tm-slurm || true)}
log=${TM_SLURM_TRIGGER_LOG:-/var/log/slurm/tm-slurm-trigger.log}
die() { echo "install.sh: $*" >&2; exit 1; }

command -v strigger >/dev/null || die "strigger not found: install slurm-client (or put it on PATH)"
[ -n "$tm" ] && [ -x "$tm" ] || die "tm-slurm not found: set TM_SLURM=/path/to/venv/bin/tm-slurm"
case $tm in /*) ;; *) tm=$(cd "$(dirname "$tm")" && pwd)/$(basename "$tm") ;; esac
# slurmctld splits the program string at spaces
for p in "$program" "$tm" "$log"; do
  case $p in *' '*) die "path with a space cannot be used in a trigger program: $p" ;; esac
done
uid=$(id -u)
slurm_user=$(scontrol show config 2>/dev/null | awk -F' *= *' '$1 == "SlurmUser" {sub(/\(.*/, "", $2); print $2}')
if [ "$uid" -ne 0 ] && [ "$(id -un)" != "$slurm_user" ]; then
  die "run as root or SlurmUser ($slurm_user): tm_slurm jobs refuse requests from other users"
fi

for event in ${TM_SLURM_TRIGGER_EVENTS:-fail down}; do
  cmd="$program --tm-slurm=$tm --log=$log $event"
  if strigger --get --noheader --node 2>/dev/null | grep -qF -- "$cmd"; then
    echo "already set: --node --$event -> $cmd"
    continue
  fi
  strigger --set --node "--$event" --flags=PERM "--program=$cmd"
  echo "set: --node --$event -> $cmd"
done
strigger --get
case $(sinfo --version 2>/dev/null) in
  *" 22.05."*) case " ${TM_SLURM_TRIGGER_EVENTS:-fail down} " in *" fail "*)
    echo "note: Slurm 22.05 never fires --fail triggers (slurmctld has no caller of its" \
         "trigger_node_failing); jobs still see State=FAIL at their own Slurm poll" ;; esac ;;
esac
