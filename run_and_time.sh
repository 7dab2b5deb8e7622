#!/usr/bin/env bash
# One timed MLPerf BERT run. The config is already in the environment; this script sources nothing:
#   source config_CPU_1x2.sh && ./run_and_time.sh      # one node: torchrun --standalone, DGXNGPU processes
#   srun --ntasks-per-node="$DGXNGPU" ./run_and_time.sh  # Slurm started one task per process: run the driver directly
# With GRAD_REDUCE=ps every node runs PS_SERVERS (default 1) more processes, the parameter servers:
# torchrun starts DGXNGPU + PS_SERVERS, and under Slurm --ntasks-per-node must be DGXNGPU + PS_SERVERS (run.sub).
# run_pretraining.py reads every setting from the environment; $EXTRA_PARAMS is passed through untouched.
# Prints STARTING/ENDING TIMING RUN lines and RESULT,bert,<seed>,<seconds>,<user>,<start>, and exits with the
# driver's status: 0 reached the target, 1 aborted, 2 bad config/path/data, 3 pre-empted after a checkpoint (no
# RESULT line: not a result; RESUME=1 with the same SEED continues it, run.sub's RESUME_FROM does).
# SIGTERM/SIGINT to this script is forwarded to the launcher (pre-emption: the driver checkpoints and exits 0,
# and tells this script so through $RUN_OUTCOME_FILE, bert/train/outcome.py); a failure is one line per rank,
# tracebacks only with DEBUG=1; a driver that died without `run_stop` gets `run_stop` aborted appended to the log
# it wrote ($MLPERF_LOG, or a continuation's result_<i>.txt.resumed-<n>).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}

fail() {
  echo "run_and_time.sh: $*" >&2
  exit 2
}

need_positive_int() {  # NAME...: shell-only variables the driver does not read
  local name
  for name in "$@"; do
    [[ ${!name:-} =~ ^[1-9][0-9]*$ ]] || fail "\$$name='${!name:-}' must be a positive integer (source a config_*.sh first)"
  done
}

need_positive_int DGXNNODES DGXNGPU
# GRAD_REDUCE=ps: PS_SERVERS parameter-server processes per node on top of the GPUs' (bert/dist/ps.py).
per_node=$DGXNGPU
if [ "${GRAD_REDUCE:-flat}" = ps ]; then
  PS_SERVERS=${PS_SERVERS:-1}
  need_positive_int PS_SERVERS
  per_node=$((DGXNGPU + PS_SERVERS))
fi
case " ${EXTRA_PARAMS:-} " in *" --grad_reduce"* | *" --ps_servers"*)
  fail "set GRAD_REDUCE and PS_SERVERS in the environment, not in EXTRA_PARAMS: they decide how many processes start" ;;
esac
nprocs=$((DGXNNODES * per_node))
# Slurm started the processes iff we are inside a job step with one task per process.
if [ -n "${SLURM_STEP_ID:-}" ] && [ "${SLURM_NTASKS:-0}" = "$nprocs" ]; then
  launcher=slurm
  # Every task runs this script: a per-task $RANDOM would give each rank its own seed.
  [[ ${SEED:-} =~ ^[0-9]+$ ]] || fail "\$SEED must be set (run.sub sets it) when Slurm starts one task per process"
else
  launcher=torchrun
  [ "$DGXNNODES" = 1 ] || fail "DGXNNODES=$DGXNNODES: more than one node needs Slurm (sbatch run.sub)"
  # a continuation draws the data of the run it continues: the loader refuses a checkpoint of another seed
  [ "${RESUME:-0}" = 0 ] || [[ ${SEED:-} =~ ^[0-9]+$ ]] ||
    fail "RESUME=1 continues a run: set SEED to its seed (the \"seed\" line of its log; run.sub's RESUME_FROM does)"
  export SEED=${SEED:-$RANDOM}
fi

read -r -a extra <<<"${EXTRA_PARAMS:-}"
# Fails on a missing, malformed or misspelled variable with one line naming it (exit 2), before anything starts;
# so does a COMPILE or PRECISION=fp8 this node's device cannot run (no GPU, no float8, torchao missing).
"$PYTHON" -m bert.train.config --check-env --check-device "${extra[@]}" >/dev/null || exit 2

main_task() {  # the timing lines come from one task only
  [ "${SLURM_PROCID:-0}" = 0 ] || [ "$launcher" = torchrun ]
}

RUN_OUTCOME_FILE=$(mktemp "${TMPDIR:-/tmp}/run_outcome.XXXXXX")  # rank 0's, on this node: the main task's
export RUN_OUTCOME_FILE
trap 'rm -f "$RUN_OUTCOME_FILE"' EXIT
outcome() { sed -n "s/^$1=//p" "$RUN_OUTCOME_FILE" | tail -n 1; }

start=$(date +%s)
start_fmt=$(date +'%Y-%m-%d %r')
main_task && echo "STARTING TIMING RUN AT $start_fmt"

# In the background, so that a signal to this script reaches the launcher instead of orphaning it.
if [ "$launcher" = slurm ]; then
  "$PYTHON" -u "$HERE/run_pretraining.py" "${extra[@]}" &
else  # bert.dist.launch: torchrun that forwards SIGTERM to the workers and reports a failure in one line
  "$PYTHON" -u -m bert.dist.launch --standalone --nnodes=1 --nproc_per_node="$per_node" \
    "$HERE/run_pretraining.py" "${extra[@]}" &
fi
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM INT
# `wait` returns early when a trapped signal arrives: wait until the launcher is gone, then ask bash for its
# status (kept for a reaped child, so asking again is safe).
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
status=0
wait "$pid" || status=$?
trap - TERM INT
log=$(outcome log)
# A continuation that died before claiming its own file closes nothing: $MLPERF_LOG is the run it continues.
[ "${RESUME:-0}" != 0 ] || log=${log:-${MLPERF_LOG:-}}
if [ "$status" != 0 ] && [ -n "$log" ] && main_task; then
  "$PYTHON" -m bert.train.abort_log "$log" || true
fi
if [ "$status" = 0 ] && [ "$(outcome status)" = preempted ]; then
  status=3
fi

end=$(date +%s)
if main_task; then
  echo "ENDING TIMING RUN AT $(date +'%Y-%m-%d %r')"
  if [ "$status" = 3 ]; then
    echo "PREEMPTED,bert,${SEED},$((end - start)): checkpoint saved; not a result (RESUME=1 SEED=${SEED} continues it)"
  else
    echo "RESULT,bert,${SEED},$((end - start)),${USER:-$(id -un)},${start_fmt}"
  fi
fi
exit "$status"
