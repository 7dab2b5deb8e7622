# shellcheck shell=bash
# DGX H100 (8x H100-SXM5-80GB per node): what every H100 config shares beyond config_DGX_common.sh.
# shellcheck source=config_DGX_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGX_common.sh"
export PRECISION=bf16  # NVIDIA used FP8 (TransformerEngine); bf16 is the nearest here, no loss scale
# The submissions' mixed precision: bf16 weights, fp32 master weights and LAMB state inside the optimizer, no
# autocast and so none of its per-step casts (bert.optim.master, [NVIDIA-BERT]). On one H100: 631 samples/s
# against 565 with autocast (README, "On one H100").
export MASTER_WEIGHTS=1
