#!/usr/bin/env bash
# One timed MLPerf BERT run. The config is already in the environment; this script sources nothing:
#   source config_CPU_1x2.sh && ./run_and_time.sh      # one node: torchrun --standalone, DGXNGPU processes
#   srun --ntasks-per-node="$DGXNGPU" ./run_and_time.sh  # Slurm started one task per process: run the driver directly
# With GRAD_REDUCE=ps every node runs PS_SERVERS (default 1) more processes, the parameter servers:
# torchrun starts DGXNGPU + PS_SERVERS, and under Slurm --ntasks-per-node must be DGXNGPU + PS_SERVERS (run.sub).
# run_pretraining.py reads every setting from the environment; $EXTRA_PARAMS is passed through untouched.
# Prints STARTING/ENDING TIMING RUN lines and RESULT,bert,<seed>,<seconds>,<user>,<start>, and exits with the
# driver's status.
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
  export SEED=${SEED:-$RANDOM}
fi

read -r -a extra <<<"${EXTRA_PARAMS:-}"
# Fails on a missing, malformed or misspelled variable with one line naming it (exit 2), before anything starts.
"$PYTHON" -m bert.train.config --check-env "${extra[@]}" >/dev/null || exit 2

main_task() {  # the timing lines come from one task only
  [ "${SLURM_PROCID:-0}" = 0 ] || [ "$launcher" = torchrun ]
}

start=$(date +%s)
start_fmt=$(date +'%Y-%m-%d %r')
main_task && echo "STARTING TIMING RUN AT $start_fmt"

set +e
if [ "$launcher" = slurm ]; then
  "$PYTHON" -u "$HERE/run_pretraining.py" "${extra[@]}"
else
  "$PYTHON" -u -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$per_node" \
    "$HERE/run_pretraining.py" "${extra[@]}"
fi
status=$?
set -e

end=$(date +%s)
if main_task; then
  echo "ENDING TIMING RUN AT $(date +'%Y-%m-%d %r')"
  echo "RESULT,bert,${SEED},$((end - start)),${USER:-$(id -un)},${start_fmt}"
fi
exit "$status"
