#!/usr/bin/env bash
# A one-host Slurm cluster (slurmctld + slurmd + munge on this machine), for run.sub tests and demos.
#   bash scripts/slurm_local.sh install   # Debian slurm-wlm + munge (needs root; skipped when present)
#   bash scripts/slurm_local.sh start     # write slurm.conf, start munged/slurmctld/slurmd, wait for `idle`
#   bash scripts/slurm_local.sh stop      # stop the daemons started by `start` and wait until they have exited
#   bash scripts/slurm_local.sh status    # sinfo
# Every command is idempotent. A munged that was running before `start` (the host's own) is used and left alone:
# `start` records the PID of a munged it starts in $OUR_MUNGED, and `stop` ends only that one.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
OUR_MUNGED=/run/slurm_local.munged.pid
# pid file:daemon name, in stopping order (munged last: the slurm daemons authenticate through it).
DAEMONS=(/run/slurmd.pid:slurmd /run/slurmctld.pid:slurmctld "$OUR_MUNGED:munged")

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    echo "slurm-wlm and munge already installed"
    return
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return  # ours from an earlier `start` (recorded then), or the host's (not ours to stop)
  fi
  rm -f "$OUR_MUNGED"
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0700 /etc/munge /var/log/munge
  chmod 0400 /etc/munge/munge.key
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  for _ in $(seq 50); do  # the forked daemon writes its PID file
    running /run/munge/munged.pid munged && break
    sleep 0.1
  done
  cp /run/munge/munged.pid "$OUR_MUNGED"
  munge -n | unmunge >/dev/null
}

write_conf() {
  local host
  host=$(hostname)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  # RealMemory below the machine's total: slurmd refuses to register a node that claims more than it has.
  # CPUs: every core this process may use; nproc alone obeys OMP_NUM_THREADS, and a 1-CPU node pends every job of
  # two tasks per node for ever.
  cat >"$CONF" <<EOF
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmUser=root
ReturnToService=2
NodeName=$host CPUs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) RealMemory=$(($(free -m | awk '/^Mem:/{print $2}') * 8 / 10)) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

running() {  # running PIDFILE [NAME]: the daemon recorded there is alive (and is NAME, not a reused PID)
  [ -s "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null && { [ -z "${2:-}" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; }
}

start() {
  start_munge
  running /run/slurmctld.pid slurmctld || { write_conf; slurmctld; }
  running /run/slurmd.pid slurmd || slurmd
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      sinfo
      return
    fi
    sleep 1
  done
  echo "slurm_local: node did not become idle; see /var/log/slurm/" >&2
  exit 1
}

exited() {  # exited PID TENTHS: wait up to TENTHS tenths of a second for PID to exit
  for _ in $(seq "$2"); do
    kill -0 "$1" 2>/dev/null || return 0
    sleep 0.1
  done
  ! kill -0 "$1" 2>/dev/null
}

stop() {
  local entry pidfile name pid
  for entry in "${DAEMONS[@]}"; do
    pidfile=${entry%%:*} name=${entry#*:}
    running "$pidfile" "$name" || continue
    pid=$(cat "$pidfile")
    kill "$pid"
    # Wait for the exit: a `start` right after must not find a daemon that is still shutting down.
    # slurmd ignores SIGTERM while it sleeps between attempts to reach a lost controller: SIGKILL then.
    exited "$pid" 150 || { kill -KILL "$pid" 2>/dev/null; exited "$pid" 50; } || {
      echo "slurm_local: $name (PID $pid) did not exit after SIGTERM and SIGKILL" >&2
      exit 1
    }
  done
  rm -f "$OUR_MUNGED"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
