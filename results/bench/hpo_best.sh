# shellcheck shell=bash
# bench/hpo.py study 'adam-bucket': best of 8 trials (trial 6, 2080 samples to MLM accuracy 0.07, tiny BERT, 2 ranks x 8).
# Source after a config_*.sh and bench/trial.py's BASE settings; found on the lab's setting, it is
# not a recipe for another model or batch.
export OPTIMIZER=adam
export GRAD_CLIP=bucket
export LR=0.00130259
export OPT_LAMB_BETA_1=0.7997
export OPT_LAMB_BETA_2=0.8707
export WARMUP_STEPS=49
export LR_MAX_STEPS=520
export END_LR=6.51294e-07
export WEIGHT_DECAY_RATE=0.00694
