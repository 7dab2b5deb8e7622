"""MLPerf BERT phase-2 pre-training under torch.distributed (torchrun or srun; gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node 2 run_pretraining.py --input_dir D --eval_dir E --bert_config_path tiny \\
        --train_batch_size 16 --learning_rate 1e-3 --max_steps 1000 [--grad_clip bucket] ...

With GRAD_REDUCE=ps the last PS_SERVERS local ranks of every node are parameter servers (`bert.dist.ps`):
they branch off at the top of `main`, build no model and write no log.

Every flag also reads an environment variable (`python -m bert.train.config --help`). Exit status:
0 when the target was reached or the job was pre-empted after a checkpoint (SIGTERM), 1 when the
run was aborted (limit reached, non-finite loss, a dead rank), 2 for a bad configuration, path or
data set (a corrupt shard found mid-run included). A failure prints one `error: rank R: ...` line;
DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from bert.config import ConfigError, TrainConfig, from_env_and_args
from bert.console import say
from bert.data.format import ShardError
from bert.dist import ps
from bert.dist.env import DistEnv, compute_device, init_distributed, raise_open_file_limit, read_env
from bert.train import outcome
from bert.train.build import build_run, resume
from bert.train.loop import ABORTED, PREEMPTED, SUCCESS, train
from bert.train.mlperf_log import MLPerfLog, ResultLogExists, claim_log_file
from bert.train.record import record_run
from bert.train.warmup import CompileWatch, compile_before_run


def report(rank: int | str, e: BaseException, suffix: str = "") -> None:
    """One line naming what failed; the traceback only on request (DEBUG=1)."""
    if os.environ.get("DEBUG") == "1":
        traceback.print_exception(e)
    lines = str(e).strip().splitlines()
    say(f"error: rank {rank}: {lines[0] if lines else type(e).__name__}{suffix}")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = from_env_and_args(argv)
    except ConfigError as e:
        say(f"error: {e}")
        return 2
    job = read_env()
    raise_open_file_limit()  # before any group: parameter servers and their workers join one of W + S sockets
    try:
        server = ps.is_server(job, cfg.dist)
    except ValueError as e:  # a rank layout that cannot hold the parameter servers
        report(job.rank, e)
        return 2
    if server:  # a CPU process that only sums gradient shards: no model, no log
        return ps.serve(job, cfg.dist)
    status = train_worker(cfg, job)
    ps.disconnect()  # the servers stop once every worker has said so (nothing without servers)
    if status != 2 and dist.is_initialized():  # a run that ended together: NCCL warns of a group left at exit
        dist.destroy_process_group()
    return status


def train_worker(cfg: TrainConfig, job: DistEnv) -> int:
    env = ps.worker_env(job, cfg.dist)  # the job itself, or its workers when it holds parameter servers
    try:
        device = compute_device(env, cfg.run.device)
    except ValueError as e:  # no GPU with DEVICE=cuda, more local ranks than GPUs
        report(env.rank, e)
        return 2
    try:  # rank 0 alone writes the log, so it alone looks: another rank could see rank 0's first lines
        log_file = claim_log_file(cfg.log.mlperf_log, cfg.run.resume) if env.is_main else ""
    except ResultLogExists as e:
        say(f"error: {e}")
        return 2
    if log_file:
        outcome.record("log", log_file)
    log = MLPerfLog(log_file, env.is_main)
    log.init_start(cfg.log.cache_cleared)
    init_distributed(env, device, cfg.dist.dist_timeout_s, store=ps.connect_worker(job, cfg.dist))
    log.submission(cfg, env.world_size)
    try:
        run = build_run(cfg, env, device, log)
        if cfg.run.resume:
            resume(run)
            run.progress.drop_after(run.state.step)
            log.resumed(run.state.step, run.state.samples)
            if env.is_main:
                print(f"resume: continuing from step {run.state.step}; {log_file or 'the log'} is not a result "
                      "(a run result is one contiguous timed run)", flush=True)
        record_run(run, device)
        compile_before_run(run, log, device)  # untimed: the rules' initialisation ends at init_stop
        run.loader.plan_ahead()  # after resume: the epoch of the step it continues at
    except (FileNotFoundError, ValueError) as e:  # bad paths or data: name the culprit
        report(env.rank, e)
        return 2
    compiled = CompileWatch(cfg)  # whatever compiles after this is compile time inside the timed run
    log.start_run()
    try:
        status = train(run)
    except Exception as e:
        # A dead rank surfaces here as a failed or timed-out collective; so do a non-finite loss and a
        # shard found corrupt by the reader thread.
        log.run_stop(run.state.samples, run.eval_samples, success=False)
        report(env.rank, e, "; run aborted")
        os._exit(2 if isinstance(e, ShardError) else 1)  # skip process-group teardown: it can block on a dead peer
    try:
        if status != PREEMPTED:
            log.run_stop(run.state.samples, run.eval_samples, success=status == SUCCESS)
        compiled.report(run.progress)
        if not cfg.run.skip_checkpoint or status == PREEMPTED:  # a pre-empted job continues from it
            run.checkpoint()  # after run_stop: saving is not part of the timed run
        if env.is_main:  # after the checkpoint: "preempted" says there is one to continue from
            outcome.record("status", status)
        run.progress.close()
    finally:
        run.loader.close()  # LOADER_WORKER=process: its child too, also when saving failed
    return 1 if status == ABORTED else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # anything unforeseen (a peer gone during init, ...): still one line
        report(os.environ.get("RANK", 0), e)
        sys.exit(1)
