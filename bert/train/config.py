"""The configuration check on the command line (`bert.config` holds the sections and the parser).

    python -m bert.train.config --check-env   # validate the environment: "config OK" or one error line, exit 2
    python -m bert.train.config --check-env --check-device   # and DEVICE, COMPILE, fp8, ATTENTION on this node
    python -m bert.train.config [--flag v]    # print the resolved configuration, section by section

`run_and_time.sh` runs the check with `--check-device` before `STARTING TIMING RUN`, so a typo in any
variable (a selector such as BALANCE or ATTENTION included), or a DEVICE=cuda, COMPILE mode, PRECISION=fp8 or
CUDA attention backend this node cannot run (no GPU, a GPU without float8, torchao missing), stops the job before
anything is logged. `--check-device` imports torch only when DEVICE, COMPILE, PRECISION=fp8 or an ATTENTION other
than auto asks for a device check. Every check first reads the installed torch's version (its package metadata, no
import): older than MIN_TORCH is one error line, since an older torch fails in ways that name nothing of ours
(torch 2.6, the NGC 25.01 image's, fails 8 of 119 tests of the model, compile, optimizer and reduction modules).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys

from bert.config import TrainConfig, from_env_and_args
from bert.release import major_minor

# The oldest torch release the suite passes on (`bash scripts/test_torch.sh 2.10.0`: all but three tests of a
# one-line error, where 2.10's gloo adds its connection messages to stderr; 2.11.0, the GPU machines', and
# 2.13.0, the CPU install's, pass it all)
MIN_TORCH = (2, 10)


def check_torch(version: str | None = None) -> None:
    """A ValueError naming the installed torch (or `version`, as pip writes it) if it is older than MIN_TORCH, or
    naming the interpreter if it has no torch (run_and_time.sh's $PYTHON pointing at a bare one)."""
    try:
        version = version or importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"torch is not installed for {sys.executable}: install it (README) or point $PYTHON at the "
                         "interpreter that has it") from None
    release = major_minor(version)
    if release is None or release < MIN_TORCH:
        raise ValueError(f"torch {version} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the oldest release this "
                         "harness is tested on: use a newer image (the Dockerfile's BASE_IMAGE) or torch")


def check_device(cfg: TrainConfig) -> None:
    """The driver's own device checks (`bert.train.build.build_model`), on the device it will pick: a GPU
    when there is one. A ValueError with one line naming the setting."""
    if cfg.model.compile == "off" and cfg.model.precision not in ("fp8", "fp32") and cfg.model.attention == "auto" \
            and cfg.model.residual_norm == "torch" and cfg.run.device == "auto":
        return  # nothing to refuse on any device (fp32: flash varlen, auto's choice on a GPU, refuses it)
    import torch

    from bert.dist.env import device_type
    from bert.model.attention import check_attention
    from bert.model.compile import check_compile
    from bert.model.dropout_add_norm import check_residual_norm
    from bert.model.fp8 import check_fp8

    device = torch.device(device_type(cfg.run.device))
    check_compile(cfg.model.compile, device)
    check_fp8(cfg.model.precision, device, cfg.model.fp8_recipe)
    head_dim = None
    if cfg.model.attention == "triton":  # its kernels' widths; the config file is read here only for this
        from bert.model.config import BertConfig
        head_dim = BertConfig.load(cfg.model.bert_config_path).head_dim
    check_attention(cfg.model.attention, device, cfg.model.precision, head_dim)
    check_residual_norm(cfg.model.residual_norm, device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = ("--check-env", "--check-device")
    check = "--check-env" in argv
    try:
        check_torch()
        cfg = from_env_and_args([a for a in argv if a not in flags])
        if "--check-device" in argv:
            check_device(cfg)
    except ValueError as e:  # ConfigError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("config OK" if check else json.dumps(cfg.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
