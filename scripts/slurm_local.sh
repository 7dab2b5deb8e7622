#!/usr/bin/env bash
# A one-host Slurm cluster (slurmctld + slurmd + munge on this machine), for run.sub tests and demos.
#   bash scripts/slurm_local.sh install   # Debian slurm-wlm + munge (needs root; skipped when present)
#   bash scripts/slurm_local.sh start     # write slurm.conf, start munged/slurmctld/slurmd, wait for `idle`
#   bash scripts/slurm_local.sh stop      # stop the daemons started by `start`
#   bash scripts/slurm_local.sh status    # sinfo
# Every command is idempotent.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
PIDS=(/run/slurmd.pid /run/slurmctld.pid)

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
    return
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0700 /etc/munge /var/log/munge
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  munge -n | unmunge >/dev/null
}

write_conf() {
  local host
  host=$(hostname)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  # RealMemory below the machine's total: slurmd refuses to register a node that claims more than it has.
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
NodeName=$host CPUs=$(nproc) RealMemory=$(($(free -m | awk '/^Mem:/{print $2}') * 8 / 10)) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

running() {  # running PIDFILE: the daemon recorded there is alive
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start() {
  start_munge
  running /run/slurmctld.pid || { write_conf; slurmctld; }
  running /run/slurmd.pid || slurmd
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

stop() {
  local pidfile
  for pidfile in "${PIDS[@]}"; do
    if running "$pidfile"; then
      kill "$(cat "$pidfile")"
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
