# shellcheck shell=bash
# 8 nodes x 8 H100, GBS 4608 = 72 x 1 x 64. LAMB, NVIDIA v3.0 config_DGXH100_8x8x72x1.sh (not packed): 0.898 min.
# shellcheck source=config_DGXH100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXH100_common.sh"
export DGXSYSTEM=DGXH100_8x8x72x1
export DGXNNODES=8
export BATCHSIZE=72
export GRADIENT_STEPS=1
export OPTIMIZER=lamb
export LR=0.00258
export OPT_LAMB_BETA_1=0.6
export OPT_LAMB_BETA_2=0.7
export EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.1
export WARMUP_STEPS=200330
export START_WARMUP_STEP=-200000
export MAX_STEPS=700
# NVIDIA's distributed LAMB reduces intra-node reduce-scatter -> inter-node allreduce -> all-gather; the same
# 2-D reduction here (Herring [003] §III-A, TPU [004] §3.3), in bf16 as TPU [004] §3.3 sums BERT's gradients
# (bf16 keeps fp32's range: no loss scale needed).
export GRAD_REDUCE=hierarchical
export GRAD_COMM_DTYPE=bf16
export EVAL_ITER_START_SAMPLES=200000
export EVAL_ITER_SAMPLES=200000
export MAX_SAMPLES_TERMINATION=4500000
export WALLTIME_MINUTES=10  # per experiment
export WALLTIME=$((${NEXP:-1} * WALLTIME_MINUTES + 5))
