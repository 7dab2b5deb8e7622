# shellcheck shell=bash
# DGX H100 (8x H100-SXM5-80GB per node): what every H100 config shares beyond config_DGX_common.sh.
# shellcheck source=config_DGX_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGX_common.sh"
export PRECISION=bf16  # NVIDIA used FP8 (TransformerEngine); bf16 is the nearest here, no loss scale
# The fastest measured bf16 step: the model compiled by inductor and the LAMB update over the fp32 masters compiled
# too, both before run_start (about 80 s). One H200, batch 96 (README, "On one H200"): 800 samples/s against 763
# with the model alone compiled, and 785 with CUDA graphs on 512-token buckets (the step is 96 % GPU-busy already).
export COMPILE=${COMPILE:-default}
if [ "$COMPILE" = off ]; then  # the update is compiled with COMPILE's mode: none to compile it with
  export COMPILE_OPTIMIZER=${COMPILE_OPTIMIZER:-0}
else
  export COMPILE_OPTIMIZER=${COMPILE_OPTIMIZER:-1}
fi
