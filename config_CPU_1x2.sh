# shellcheck shell=bash
# The embedded default: a tiny BERT on the embedded Wikipedia corpus (prepared by data/prepare.py --embedded),
# 2 CPU processes over gloo, open division (a demo target, not the benchmark's 0.720 on the real eval set).
# Paths may be set before sourcing; BERT_DATA is where `data/prepare.py --embedded --out` wrote the corpus.
export BERT_DATA=${BERT_DATA:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/work/data}
export DATADIR_PHASE2=${DATADIR_PHASE2:-${BERT_DATA}/train_varlength}
export EVALDIR=${EVALDIR:-${BERT_DATA}/eval_varlength}
# From scratch: MiniLM-L6-H384's encoder (BERT_CONFIG=minilm INIT_CHECKPOINT=minilm, fresh MLM/NSP heads) is the
# phase-1 start this machine has, but on 2 cores it loses in a few minutes: in 480 s each (load average 15-20,
# shared machine) from scratch reached 0.0744 at 2720 samples, MiniLM at most 0.0506 in 480 samples (1.1 samples/s; its
# fresh head has not left the frequent-token plateau). results/bench/phase2_from_minilm.json, from
#   .venv/bin/python bench/phase2_init.py --data work/data --seconds 480
export BERT_CONFIG=tiny
export INIT_CHECKPOINT=""
export DGXSYSTEM=CPU_1x2
export DGXNNODES=1
export DGXNGPU=2
export MLPERF_DIVISION=open
export PRECISION=fp32
export ATTENTION=auto  # per-sequence SDPA on the CPU
export BALANCE=global
export GRAD_CLIP=after
export BATCHSIZE=8
export GRADIENT_STEPS=1
export OPTIMIZER=lamb
export LR=0.015
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export WARMUP_STEPS=10
export START_WARMUP_STEP=0
export MAX_STEPS=1000
export EVAL_ITER_START_SAMPLES=800
export EVAL_ITER_SAMPLES=800
export MAX_SAMPLES_TERMINATION=16000
export NUM_EVAL_EXAMPLES=500
export EVAL_BATCHSIZE=100
# Guessing the most frequent token plateaus at 0.055 on this eval set; 0.08 needs real learning: measured
# 0.0845 at 3200 samples (seed 7, 143 s wall on the shared 2-core machine), 0.091 at 4800 (seed 42).
export TARGET_MLM_ACCURACY=0.08
export LOG_FREQ=10  # a loss point every 10 steps for the plot (no device sync cost on CPU)
export EXTRA_PARAMS=""
export WALLTIME_MINUTES=20  # per experiment
export WALLTIME=$((${NEXP:-1} * WALLTIME_MINUTES + 5))
