# shellcheck shell=bash
# 128 nodes x 8 A100, GBS 16384 = 16 x 1 x 1024. Samsung's recipe (v1.1/v2.0 config_Samsung_Supercomputer21_DGXA100_128x8x16x1.sh,
# [000], [Samsung-BERT]): ADAM (hyperparameters logged under the LAMB keys), linear decay to END_LR at step 179 then held,
# bucket-wise gradient clipping before the all-reduce (DDP comm hook), and stratified sampling (6/3/2/5 per 16)
# + per-node presort + snake assignment for load balance.
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
export DGXSYSTEM=DGXA100_128x8x16x1
export DGXNNODES=128
export BATCHSIZE=16
export GRADIENT_STEPS=1
export OPTIMIZER=adam
export LR=0.00039299421615882676
export OPT_LAMB_BETA_1=0.8003575444254268
export OPT_LAMB_BETA_2=0.8174653681457493
export EPSILON=1e-9
export WEIGHT_DECAY_RATE=0.0028861703130042965
export WARMUP_STEPS=82
export START_WARMUP_STEP=-16
export MAX_STEPS=299
export EVAL_ITER_START_SAMPLES=325000
export EVAL_ITER_SAMPLES=325000
export MAX_SAMPLES_TERMINATION=5000000
export LR_MAX_STEPS=179
export END_LR=0.0000494549100544884
# Clipping before the all-reduce was allowed in the closed division for v1.0 and v1.1, when Samsung submitted it;
# since then the rules expect clipping after the reduction (no checker tests it): for a closed result under
# today's rules, GRAD_CLIP=after.
export GRAD_CLIP=bucket
export BALANCE=samsung
# 1024 ranks at 16 sequences each: the step is communication-bound. Hierarchical reduction (Herring [003] §III-A)
# sends 1/8 of every bucket over the network on 8x shorter inter-node rings; fp16 buckets are what Samsung
# allreduced (apex amp keeps fp16 gradients), range kept by the fp16 loss scale. Nodes = DGXNGPU ranks each.
export GRAD_REDUCE=hierarchical
export GRAD_COMM_DTYPE=fp16
export WALLTIME_MINUTES=10  # per experiment
export WALLTIME=$((${NEXP:-1} * WALLTIME_MINUTES + 5))
