"""Training configuration: one typed dataclass, read from defaults < environment < command line.

Every field has a type, a default, the flag of the public MLPerf submissions (`--field_name`)
and, where the NVIDIA-style shell configs set it, an environment variable. The shell
configs (`config_<SYSTEM>_<NODES>x<GPUS>.sh`) only export those variables; nothing builds
flag strings in shell. A malformed or unknown value is an error that names the variable.

    python -m bert.train.config --check-env   # validate the environment, print the resolved config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

OPTIMIZERS = ("lamb", "adam")
CLIP_MODES = ("none", "after", "before", "bucket")
PRECISIONS = ("fp32", "bf16", "fp16")
DIVISIONS = ("closed", "open")


def opt(default: Any, help: str, env: str | None = None, choices: tuple | None = None, required: bool = False):
    return field(default=default, metadata={"help": help, "env": env, "choices": choices, "required": required})


@dataclass
class TrainConfig:
    # --- data
    input_dir: str = opt("", "directory of varlength training shards", env="DATADIR_PHASE2", required=True)
    eval_dir: str = opt("", "directory holding the varlength eval set", env="EVALDIR", required=True)
    output_dir: str = opt("./results", "checkpoints, metrics.jsonl", env="OUTPUT_DIR")
    max_seq_length: int = opt(512, "longest sequence", env="MAX_SEQ_LENGTH")
    max_predictions_per_seq: int = opt(76, "masked positions per sequence at most", env="MAX_PRED")
    num_eval_examples: int = opt(10000, "eval-set size", env="NUM_EVAL_EXAMPLES")
    eval_batch_size: int = opt(16, "sequences per rank per eval step", env="EVAL_BATCHSIZE")
    balance: str = opt("none", "load-balance strategy (bert.balance.STRATEGIES)", env="BALANCE")
    shuffle_buffer: int = opt(10000, "samples in the shuffle buffer (TPU paper 3.5)", env="SHUFFLE_BUFFER")
    # --- model
    bert_config_path: str = opt("", "bert_config.json, or a named config such as 'tiny'", env="BERT_CONFIG",
                                required=True)
    init_checkpoint: str = opt("", "phase-1 weights (ours, HF or converted TF); empty = random init",
                               env="INIT_CHECKPOINT")
    attention: str = opt("auto", "attention backend (bert.model.attention)", env="ATTENTION")
    precision: str = opt("fp32", "compute precision", env="PRECISION", choices=PRECISIONS)
    init_loss_scale: float = opt(2.0**16, "initial fp16 loss scale", env="INIT_LOSS_SCALE")
    # --- optimisation
    train_batch_size: int = opt(0, "sequences per rank per micro-step", env="BATCHSIZE", required=True)
    gradient_accumulation_steps: int = opt(1, "micro-steps per optimizer step", env="GRADIENT_STEPS")
    optimizer: str = opt("lamb", "optimizer", env="OPTIMIZER", choices=OPTIMIZERS)
    learning_rate: float = opt(0.0, "peak learning rate", env="LR", required=True)
    opt_lamb_beta_1: float = opt(0.9, "beta1 (LAMB and ADAM)", env="OPT_LAMB_BETA_1")
    opt_lamb_beta_2: float = opt(0.999, "beta2 (LAMB and ADAM)", env="OPT_LAMB_BETA_2")
    opt_epsilon: float = opt(1e-6, "epsilon (Samsung's ADAM: 1e-9)", env="EPSILON")
    weight_decay_rate: float = opt(0.01, "decoupled weight decay; 0 on biases and LayerNorm",
                                   env="WEIGHT_DECAY_RATE")
    warmup_steps: int = opt(0, "linear warmup length in steps", env="WARMUP_STEPS")
    start_warmup_step: int = opt(0, "step at which warmup starts (may be negative)", env="START_WARMUP_STEP")
    max_steps: int = opt(0, "optimizer steps of the LR schedule", env="MAX_STEPS", required=True)
    lr_max_steps: int = opt(0, "step where polynomial decay ends and the LR is held (0 = max_steps)",
                            env="LR_MAX_STEPS")
    end_learning_rate: float = opt(0.0, "LR reached at lr_max_steps", env="END_LR")
    lr_poly_power: float = opt(1.0, "polynomial decay power", env="LR_POLY_POWER")
    grad_clip: str = opt("after", "where gradients are clipped", env="GRAD_CLIP", choices=CLIP_MODES)
    max_grad_norm: float = opt(1.0, "clip threshold c", env="MAX_GRAD_NORM")
    bucket_cap_mb: float = opt(25.0, "DDP bucket size", env="BUCKET_CAP_MB")
    # --- run control and evaluation
    seed: int = opt(42, "random seed", env="SEED")
    max_samples_termination: int = opt(14_000_000, "stop (aborted) after this many samples",
                                       env="MAX_SAMPLES_TERMINATION")
    eval_iter_start_samples: int = opt(0, "first eval at this sample count (0 = rules' formula)",
                                       env="EVAL_ITER_START_SAMPLES")
    eval_iter_samples: int = opt(0, "eval every this many samples (0 = rules' formula)", env="EVAL_ITER_SAMPLES")
    target_mlm_accuracy: float = opt(0.720, "stop with success at this eval MLM accuracy",
                                     env="TARGET_MLM_ACCURACY")
    log_freq: int = opt(50, "host-device sync and progress line every N steps", env="LOG_FREQ")
    checkpoint_every: int = opt(0, "checkpoint every N steps (0 = only at the end)", env="CHECKPOINT_EVERY")
    skip_checkpoint: bool = opt(False, "write no final checkpoint (BERT-large: 1.3 GB per run)", env="SKIP_CHECKPOINT")
    resume: bool = opt(False, "continue from the latest checkpoint in output_dir", env="RESUME")
    steps_this_job: int = opt(0, "optimizer steps this job may take, then checkpoint and exit (0 = no limit; "
                              "for walltime-limited jobs, continued with --resume)", env="STEPS_THIS_JOB")
    dist_timeout_s: int = opt(300, "collective timeout: a dead rank ends the job after this", env="DIST_TIMEOUT")
    # --- MLPerf result log
    mlperf_log: str = opt("", "result log path (rank 0); empty = stdout only", env="MLPERF_LOG")
    cache_cleared: bool = opt(False, "the launcher dropped the page cache before this run (logged as cache_clear)",
                              env="CACHE_CLEARED")
    division: str = opt("open", "submission division", env="MLPERF_DIVISION", choices=DIVISIONS)
    org: str = opt("bert-harness", "submitting organisation", env="MLPERF_ORG")
    platform: str = opt("cpu", "system name", env="DGXSYSTEM")
    status: str = opt("onprem", "system status", env="MLPERF_STATUS")

    @property
    def global_batch_size_per_rank(self) -> int:
        return self.train_batch_size * self.gradient_accumulation_steps

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta["choices"] and value not in meta["choices"]:
                raise ConfigError(f.name, meta["env"], value, f"must be one of {', '.join(meta['choices'])}")
            if meta["required"] and value in ("", 0, 0.0):
                raise ConfigError(f.name, meta["env"], value, "is required")
        for name in ("train_batch_size", "gradient_accumulation_steps", "max_steps", "eval_batch_size",
                     "num_eval_examples", "max_seq_length", "log_freq"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, _env(name), getattr(self, name), "must be positive")
        if not 0.0 < self.target_mlm_accuracy < 1.0:
            raise ConfigError("target_mlm_accuracy", _env("target_mlm_accuracy"), self.target_mlm_accuracy,
                              "is a fraction in (0, 1)")
        if self.learning_rate <= 0:
            raise ConfigError("learning_rate", "LR", self.learning_rate, "must be positive")
        if self.resume and self.division == "closed":  # training rules: a run result is one contiguous run
            raise ConfigError("resume", "RESUME", True, "is not allowed in the closed division (a timed run may "
                              "not be continued); set MLPERF_DIVISION=open to finish it as a non-result")


class ConfigError(ValueError):
    def __init__(self, name: str, env: str | None, value: Any, problem: str):
        where = f"--{name}" + (f" / ${env}" if env else "")
        super().__init__(f"config: {where} = {value!r} {problem}")


def _env(name: str) -> str | None:
    return {f.name: f.metadata["env"] for f in dataclasses.fields(TrainConfig)}[name]


def _parse(f: dataclasses.Field, raw: str, source: str) -> Any:
    try:
        if f.type in ("bool", bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if f.type in ("int", int):
            as_float = float(raw)  # accept 4.5e6 as the shell configs write it
            if as_float != int(as_float):
                raise ValueError(raw)
            return int(as_float)
        if f.type in ("float", float):
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f.name, f.metadata["env"], raw, f"from {source} is not a valid {f.type}") from None


def from_env_and_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> TrainConfig:
    """Defaults, then environment variables, then `--flag value` arguments; validated."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        env = f.metadata["env"]
        if env and env in environ:
            values[f.name] = _parse(f, environ[env], f"${env}")
    parser = argparse.ArgumentParser(description="MLPerf BERT phase-2 pre-training",
                                     argument_default=argparse.SUPPRESS)
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{f.name}", type=str, help=f.metadata["help"])
    for name, raw in vars(parser.parse_args(argv)).items():
        field_ = next(x for x in dataclasses.fields(TrainConfig) if x.name == name)
        values[name] = _parse(field_, raw, f"--{name}")
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


def main() -> int:
    check = "--check-env" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--check-env"]
    try:
        cfg = from_env_and_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(cfg), indent=1) if not check else "config OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
