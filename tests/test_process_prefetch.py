"""LOADER_WORKER=process (bert.data.process_prefetch): the training batches made in a forked child.

The reference is the thread loader (bert.data.prefetch): the same batches in the same order, a resume continuing
alike. Beside it, what a child adds: it reads nothing before the first batch is asked for (the rules' clock), its
errors reach the trainer with their message, and `close` ends it, also while it waits on a full queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bert.batch import Batch
from bert.config import ConfigError
from bert.data.format import ShardError
from bert.data.pipeline import TrainLoader
from bert.data.process_prefetch import ProcessPrefetcher
from bert.synthetic import random_batch

ROOT = Path(__file__).resolve().parents[1]


def loader(data: Path, worker: str) -> TrainLoader:
    return TrainLoader(data / "train_varlength", 4, 2, 1, 2, strategy="samsung", seed=5, worker=worker)


def same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.input_ids, b.input_ids), (a.seq.cu_seqlens, b.seq.cu_seqlens),
                                              (a.masked_labels, b.masked_labels), (a.nsp_labels, b.nsp_labels)))


def test_the_process_loader_gives_the_thread_loaders_batches_and_resumes_alike(synthetic_data):
    thread, process = loader(synthetic_data, "thread"), loader(synthetic_data, "process")
    try:
        process.plan_ahead()  # forks the child here, as the driver does before run_start
        a, b = [next(thread) for _ in range(5)], [next(process) for _ in range(5)]
        assert all(same(x, y) for x, y in zip(a, b, strict=True))
        assert not same(a[0], a[1])  # the comparison is not vacuous
        state = process.state_dict()
        resumed = loader(synthetic_data, "process")
        resumed.load_state_dict(state)
        try:
            assert same(next(resumed), next(thread))
        finally:
            resumed.close()
    finally:
        thread.close()
        process.close()


def written(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_the_child_reads_nothing_before_the_first_batch_is_asked_for(tmp_path):
    log = tmp_path / "steps"

    def produce(step: int) -> Batch:
        with log.open("a") as f:
            f.write(f"{step}\n")
        return random_batch([30, 50], seed=step)

    worker = ProcessPrefetcher(produce, start=7, depth=2, pin=False)
    try:
        time.sleep(0.5)
        assert written(log) == []
        assert [int(worker.next().input_ids.numel()) for _ in range(3)] == [80, 80, 80]
        assert written(log)[:3] == [7, 8, 9]
    finally:
        worker.close()


def test_an_error_in_the_child_is_raised_by_next_with_its_message(tmp_path):
    def produce(step: int) -> Batch:
        if step == 2:
            raise ShardError("/data/part_00003.hdf5: sample 17 unreadable (corrupt shard?)")
        return random_batch([40], seed=step)

    worker = ProcessPrefetcher(produce, start=0, depth=1, pin=False)
    try:
        worker.next(), worker.next()
        with pytest.raises(ShardError) as raised:
            worker.next()
        # the driver prints str(e)'s first line; the child's traceback rides along as a note (DEBUG=1)
        assert str(raised.value) == "/data/part_00003.hdf5: sample 17 unreadable (corrupt shard?)"
        notes = getattr(raised.value, "__notes__", ["in the data loader process: in produce"])  # Python >= 3.11
        assert "in the data loader process" in notes[0] and "in produce" in notes[0]
        assert not worker._process.is_alive()  # `next` raising ended the child
    finally:
        worker.close()

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("not this one")

    def bad(step: int) -> Batch:
        raise Unpicklable("a lock inside")

    worker = ProcessPrefetcher(bad, start=0, depth=1, pin=False)
    try:
        with pytest.raises(RuntimeError) as raised:
            worker.next()
        assert str(raised.value) == "Unpicklable: a lock inside"
    finally:
        worker.close()


def test_close_ends_the_child_while_it_waits_on_a_full_queue():
    worker = ProcessPrefetcher(lambda step: random_batch([60], seed=step), start=0, depth=1, pin=False)
    worker.next()
    time.sleep(0.5)  # the child has filled the queue and the pinning thread holds one more: it waits
    child = worker._process
    start = time.perf_counter()
    worker.close()
    assert not child.is_alive() and child.exitcode == 0 and time.perf_counter() - start < 5


def test_the_setting_is_checked_when_the_config_is_parsed():
    from test_config import parse

    assert parse(LOADER_WORKER="process").data.loader_worker == "process"
    assert parse().data.loader_worker == "thread"
    with pytest.raises(ConfigError, match=r"LOADER_WORKER = 'procces' must be one of thread, process"):
        parse(LOADER_WORKER="procces")


def test_the_driver_trains_with_its_batches_from_a_child(world_of_one, synthetic_data, tmp_path):
    from test_loop import make_run

    from bert.train.loop import train_step

    run = make_run(synthetic_data, tmp_path, loader_worker="process")
    try:
        run.loader.plan_ahead()
        assert run.loader.worker == "process" and run.loader._worker._process.is_alive()
        batches = iter(run.loader)
        losses = [float(train_step(run, batches)) for _ in range(2)]
    finally:
        run.loader.close()
    assert all(0 < loss < 20 for loss in losses)


def test_the_gil_bench_times_each_loader_beside_the_launches(tmp_path, capsys):
    """bench/loader_gil.py at a small size: a row per loader with its launch times (not judged: a benchmark)."""
    import json

    from script_modules import load_script

    bench = load_script("bench/loader_gil.py")
    out = tmp_path / "loader_gil.json"
    assert bench.main(["--shards", "8", "--samples-per-shard", "40", "--batch", "8", "--steps", "4", "--ops", "50",
                       "--chunks", "5", "--gpu-ms", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "thread", "process"]
    assert all(0 < r["launch_ms_median"] <= r["launch_ms_p90"] <= r["launch_ms_max"] for r in rows)
    assert "process" in capsys.readouterr().out


def child_script(tmp_path: Path, ending: str) -> subprocess.CompletedProcess:
    """A trainer in a process of its own: forks the loader, takes a batch, prints the child's pid, then `ending`.
    The child's second batch takes 60 s (a read stuck on a slow file system), so only the kernel or a signal can
    end it before then."""
    script = tmp_path / "trainer.py"
    script.write_text(f"""
import os, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
from bert.data.process_prefetch import ProcessPrefetcher
from bert.synthetic import random_batch
signal.signal(signal.SIGTERM, lambda *_: None)  # as the driver's StopAgreement: a flag, inherited by a fork
worker = ProcessPrefetcher(lambda step: time.sleep(60 * step) or random_batch([60], seed=step), start=0, depth=1,
                           pin=False)
worker.next()
print(worker._process.pid, flush=True)
{ending}
""")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)


def gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_trainer_leaving_without_close_exits_and_so_does_the_child(tmp_path):
    """An exception on the trainer's way out (a checkpoint on a full disk) skips `close`: multiprocessing's exit
    handler joins daemon children without a timeout after a SIGTERM, which the child ignores (a review: the trainer
    hung until SIGKILL). The loader asks its child to stop first."""
    start = time.monotonic()
    out = child_script(tmp_path, "raise SystemExit(3)")
    assert out.returncode == 3 and time.monotonic() - start < 30, out.stderr
    assert gone(int(out.stdout.split()[0]))


def test_a_trainer_that_dies_takes_the_child_with_it(tmp_path):
    """SIGKILLed (or os._exit), the trainer runs no exit handler: the kernel kills the child (PR_SET_PDEATHSIG),
    which would otherwise hold the trainer's sockets and device files until it next looked for its parent."""
    out = child_script(tmp_path, "os._exit(0)")
    assert out.returncode == 0 and gone(int(out.stdout.split()[0]))


def test_a_killed_child_is_one_error_saying_so():
    """The child killed (for memory, say): the next batch is a RuntimeError naming its exit, not a broken pipe."""
    worker = ProcessPrefetcher(lambda step: random_batch([60], seed=step), start=0, depth=2, pin=False)
    try:
        worker.next()
        time.sleep(0.3)  # batches wait in the queue, their shared memory held by the child
        os.kill(worker._process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"^the data loader process exited \(code -9, killed by signal 9 "
                                               r"\(out of memory\?\)\)$"):
            for _ in range(5):
                worker.next()
    finally:
        worker.close()


def test_the_child_frees_nothing_it_inherits_that_holds_a_gloo_group(tmp_path):
    """In the full suite the child crashed (SIGSEGV) or hung in ProcessGroupGloo's destructor, whose threads a fork
    does not copy: it had freed what it inherited. Two ways, both here: the trainer's SIGTERM handler (a bound method
    of an object holding a gloo group, its last reference) replaced in the child, and a garbage cycle holding a
    group that the child's collector would collect."""
    script = tmp_path / "trainer.py"
    script.write_text(f"""
import gc, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import torch.distributed as dist
from bert.data.process_prefetch import ProcessPrefetcher
from bert.synthetic import random_batch
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)

class Stop:  # as bert.train.faults.StopAgreement: its own gloo group, a signal handler
    def __init__(self):
        self.group = dist.new_group(backend="gloo")
    def on_signal(self, *_):
        pass

signal.signal(signal.SIGTERM, Stop().on_signal)  # the handler holds the last reference, once
gc.disable()  # the cycle below stays uncollected here until the fork
cycle = Stop()
cycle.me = cycle
del cycle
dist.destroy_process_group()  # as the test fixtures' teardown: torch's registry lets go of the groups
# the child collects, as its collector would when it allocates enough
worker = ProcessPrefetcher(lambda step: gc.collect() and None or random_batch([60] * (step + 1), seed=step), start=0,
                           depth=1, pin=False)
gc.enable()
print([int(worker.next().input_ids.numel()) for _ in range(40)][-1])
worker.close()
print("exit", worker._process.exitcode)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["2400", "exit", "0"], out.stderr[-2000:]
