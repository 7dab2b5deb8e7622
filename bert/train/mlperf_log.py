"""The MLPerf result log (ruleset 5.0.0, BERT), written by rank 0 only.

Traps handled here: `mllog.config(filename=...)` appends, so the logger gets its own handler that
truncates the file (`claim_log_file` has checked that it holds no log); values must be plain JSON (no
tensors); `metadata.file/lineno` must point at the caller (the package checker's seed check reads it),
hence `stack_offset`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mlperf_logging import mllog
from mlperf_logging.mllog import constants as C

from bert.config import TrainConfig

RESUMED = "resumed_from_checkpoint"  # value: the checkpoint's step; logging/verify_result.py refuses such a log


class ResultLogExists(FileExistsError):
    pass


def claim_log_file(path: str, resume: bool) -> str:
    """The file this run logs to. A log already in `path` is never truncated or appended to: a fresh run is
    refused, a resumed one gets the next free `<path>.resumed-<n>` (created here, atomically). An empty
    file is free: run.sub claims result_<i>.txt by creating it empty."""
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return path
    if not resume:
        raise ResultLogExists(f"--mlperf_log / $MLPERF_LOG: {path} already holds a log; refusing to overwrite it "
                              "(give a new file; RESUME=1 logs a continuation to a file of its own)")
    n = 1
    while True:
        candidate = f"{path}.resumed-{n}"
        try:
            os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return candidate
        except FileExistsError:
            n += 1


class MLPerfLog:
    def __init__(self, path: str, enabled: bool, *, append: bool = False):
        """`append` is for `bert.train.abort_log` alone, which closes a log its dead driver left open; a run
        never appends (`claim_log_file` gives it a file of its own)."""
        self.enabled = enabled
        if not enabled:
            return
        logger = logging.getLogger("bert_mlperf_result")  # mllog's own name would share its appending handler
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.handlers.clear()
        logger.addHandler(logging.StreamHandler(sys.stdout))
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            logger.addHandler(logging.FileHandler(path, mode="a" if append else "w"))
        self._ml = mllog.get_mllogger()
        if self._ml.logger is not logger:  # mllog refuses to be configured twice with the same logger
            mllog.config(logger=logger)

    def _log(self, kind: str, key: str, value, metadata: dict | None) -> None:
        # Frames above mllog: _log, the public method, its caller -> the caller is what the log names.
        if self.enabled:
            getattr(self._ml, kind)(key=key, value=value, metadata=metadata, stack_offset=3)

    def event(self, key: str, value=None, metadata: dict | None = None) -> None:
        self._log("event", key, value, metadata)

    def start(self, key: str, value=None, metadata: dict | None = None) -> None:
        self._log("start", key, value, metadata)

    def end(self, key: str, value=None, metadata: dict | None = None) -> None:
        self._log("end", key, value, metadata)

    def init_start(self, cache_cleared: bool) -> None:
        """`cache_clear` states what the launcher did (the checker requires the key, any value)."""
        self._log("event", C.CACHE_CLEAR, cache_cleared, None)
        self._log("start", C.INIT_START, None, None)

    def submission(self, cfg: TrainConfig, world_size: int) -> None:
        """Submission info and every hyperparameter closed_bert.yaml requires (each exactly once)."""
        log, data, opt = cfg.log, cfg.data, cfg.optim
        for key, value in [
            (C.SUBMISSION_BENCHMARK, "bert"), (C.SUBMISSION_ORG, log.org), (C.SUBMISSION_DIVISION, log.division),
            (C.SUBMISSION_STATUS, log.status), (C.SUBMISSION_PLATFORM, log.platform), (C.SEED, cfg.run.seed),
            (C.GLOBAL_BATCH_SIZE, cfg.global_batch_size_per_rank * world_size),
            (C.GRADIENT_ACCUMULATION_STEPS, opt.gradient_accumulation_steps),
            ("max_sequence_length", data.max_seq_length), ("max_predictions_per_seq", data.max_predictions_per_seq),
            (C.OPT_NAME, opt.optimizer), (C.OPT_BASE_LR, opt.learning_rate),
            (C.OPT_LAMB_EPSILON, opt.opt_epsilon), ("opt_epsilon", opt.opt_epsilon),
            (C.OPT_LR_TRAINING_STEPS, opt.max_steps), (C.OPT_LR_WARMUP_STEPS, opt.warmup_steps),
            (C.NUM_WARMUP_STEPS, opt.warmup_steps), (C.START_WARMUP_STEP, opt.start_warmup_step),
            (C.OPT_LAMB_BETA_1, opt.opt_lamb_beta_1), (C.OPT_LAMB_BETA_2, opt.opt_lamb_beta_2),
            (C.OPT_LAMB_WEIGHT_DECAY, opt.weight_decay_rate),
            (C.OPT_LAMB_LR_DECAY_POLY_POWER, opt.lr_poly_power), ("opt_learning_rate_end", opt.end_learning_rate),
        ]:
            self._log("event", key, value, None)

    def start_run(self) -> None:
        """init_stop, run_start and the first block_start, with every rank in step on both sides (as NVIDIA's
        `run_start` with sync): the clock starts when the slowest rank's initialisation (its compile included) is
        over, not rank 0's, and no rank trains before rank 0 has written run_start, so a rank that fails at its
        first batch cannot end the job before the log says the run started (abort_log then closes it)."""
        from bert.dist.env import barrier  # here: the module stays torch-free for abort_log, run after a failure

        barrier()
        self._log("end", C.INIT_STOP, None, None)
        self._log("start", C.RUN_START, None, None)
        self._log("start", C.BLOCK_START, None, {C.FIRST_EPOCH_NUM: 1, C.EPOCH_COUNT: 1})
        barrier()

    def resumed(self, step: int, samples: int) -> None:
        """Labels a continuation: it is not a run result (the rules time one contiguous run)."""
        self._log("event", RESUMED, int(step), {"samples": int(samples)})

    def eval_result(self, samples: int, accuracy: float) -> None:
        self._log("event", C.EVAL_ACCURACY, float(accuracy), {C.EPOCH_NUM: int(samples)})

    def run_stop(self, samples: int, eval_samples: int, success: bool) -> None:
        self._log("end", C.BLOCK_STOP, None, {C.FIRST_EPOCH_NUM: 1})
        self._log("event", C.TRAIN_SAMPLES, int(samples), None)
        self._log("event", C.EVAL_SAMPLES, int(eval_samples), None)
        self._log("end", C.RUN_STOP, None, {C.STATUS: C.SUCCESS if success else C.ABORTED})
