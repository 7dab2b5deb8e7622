# shellcheck shell=bash
# 1 node x 8 H100, GBS 768 = 96 x 1 x 8. LAMB, NVIDIA v3.1 config_DGXH100_1x8x48x1_pack.sh (48 packed samples of ~2
# sequences per GPU) unpacked: 96 unpadded sequences per GPU carry the same tokens. 5.47 min published (packed, FP8).
# shellcheck source=config_DGXH100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXH100_common.sh"
export DGXSYSTEM=DGXH100_1x8x96x1
export DGXNNODES=1
export BATCHSIZE=96
export GRADIENT_STEPS=1
export OPTIMIZER=lamb
export LR=0.00096
export OPT_LAMB_BETA_1=0.60466
export OPT_LAMB_BETA_2=0.85437
export EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.1
export WARMUP_STEPS=0
export START_WARMUP_STEP=0
export MAX_STEPS=3680
export EVAL_ITER_START_SAMPLES=150000
export EVAL_ITER_SAMPLES=150000
export MAX_SAMPLES_TERMINATION=4500000
export WALLTIME_MINUTES=20  # per experiment
export WALLTIME=$((${NEXP:-1} * WALLTIME_MINUTES + 5))
