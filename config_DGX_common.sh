# shellcheck shell=bash
# What every DGX config shares (A100 and H100): site paths, division, the benchmark's target and eval set,
# and NVIDIA's choices (clip after all-reduce, exchange padding). Sourced by config_DGX{A,H}100_common.sh;
# exports variables only. Paths may be set before sourcing.
export DGXNGPU=8
export DATADIR_PHASE2=${DATADIR_PHASE2:-/raid/datasets/bert/hdf5/4320_shards_varlength}
export EVALDIR=${EVALDIR:-/raid/datasets/bert/hdf5/eval_varlength}
export CHECKPOINTDIR_PHASE1=${CHECKPOINTDIR_PHASE1:-/raid/datasets/bert/checkpoints/checkpoint_phase1}
export INIT_CHECKPOINT=${INIT_CHECKPOINT:-${CHECKPOINTDIR_PHASE1}/model.ckpt-28252.safetensors}  # data/convert_tf_checkpoint.py output
export BERT_CONFIG=${BERT_CONFIG:-${CHECKPOINTDIR_PHASE1}/bert_config.json}
export MLPERF_DIVISION=closed
export DEVICE=cuda  # a node whose tasks see no GPU stops in one line instead of training on its CPU
export ATTENTION=auto  # flash attention on the unpadded tokens when CUDA is there
# The submissions' mixed precision: the model's weights in fp16/bf16, fp32 master weights and optimizer state
# inside the optimizer, no autocast and so none of its per-step casts (bert.optim.master). NVIDIA's A100 recipe
# (--fp16 --distributed_lamb) casts the model to fp16 and keeps the masters in DistributedFusedLAMB, which skips an
# overflowed step on the GPU, as bert.optim.master does [NVIDIA-BERT]. On one H100 (bf16): 631 samples/s against
# 565 with autocast (README, "On one H100"); not measured on an A100.
export MASTER_WEIGHTS=1
export GRAD_CLIP=after  # the rules' expectation since v1.1 (clip-before was a v1.0/v1.1 allowance)
export BALANCE=global  # NVIDIA's exchange padding: world-wide length sort, round-robin to GPUs
export TARGET_MLM_ACCURACY=0.720
export NUM_EVAL_EXAMPLES=10000
export SKIP_CHECKPOINT=${SKIP_CHECKPOINT:-1}  # no 1.3 GB final checkpoint per run (NVIDIA: --skip_checkpoint)
export EXTRA_PARAMS=""
