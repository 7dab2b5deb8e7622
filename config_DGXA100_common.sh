# shellcheck shell=bash
# DGX A100 (8x A100-SXM4-80GB per node): what every A100 config shares beyond config_DGX_common.sh.
# shellcheck source=config_DGX_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGX_common.sh"
export PRECISION=fp16
