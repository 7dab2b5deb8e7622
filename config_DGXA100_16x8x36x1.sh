# shellcheck shell=bash
# 16 nodes x 8 A100, GBS 4608 = 36 x 1 x 128. LAMB with NVIDIA's published GBS-4608 recipe (v3.0 DGXH100_8x8x72x1;
# NVIDIA has no 16-node A100 config). WARMUP_STEPS/START_WARMUP_STEP = 200330/-200000 is their near-constant LR:
# the warmup starts almost at the peak and ends at step 330.
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
export DGXSYSTEM=DGXA100_16x8x36x1
export DGXNNODES=16
export BATCHSIZE=36
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
export EVAL_ITER_START_SAMPLES=200000
export EVAL_ITER_SAMPLES=200000
export MAX_SAMPLES_TERMINATION=4500000
export WALLTIME_MINUTES=15  # per experiment
export WALLTIME=$((${NEXP:-1} * WALLTIME_MINUTES + 5))
