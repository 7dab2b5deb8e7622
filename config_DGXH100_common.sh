# shellcheck shell=bash
# DGX H100 (8x H100-SXM5-80GB per node): what every H100 config shares beyond config_DGX_common.sh.
# shellcheck source=config_DGX_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGX_common.sh"
export PRECISION=bf16  # NVIDIA used FP8 (TransformerEngine); bf16 is the nearest here, no loss scale
