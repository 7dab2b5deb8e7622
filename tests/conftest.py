"""Fixtures shared across test modules."""

from __future__ import annotations

import fcntl
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory) -> Path:
    """data/make_synthetic_dataset.py's default dataset, made once per session; tests only read it."""
    out = tmp_path_factory.mktemp("synthetic")
    subprocess.run([sys.executable, str(ROOT / "data" / "make_synthetic_dataset.py"), "--out", str(out)], check=True,
                   capture_output=True)
    return out


@pytest.fixture
def random_shards(tmp_path) -> Path:
    """40 training and 30 eval samples as data/make_random_shards.py makes them (phase-2 lengths, random tokens),
    in its layout: what bench/train_gpu.py reads (it scans the eval set)."""
    import numpy as np
    from script_modules import load_script

    from bert.data.format import write_varlength_shard

    if str(ROOT / "data") not in sys.path:  # the script imports its neighbour md5_list
        sys.path.insert(0, str(ROOT / "data"))
    shards = load_script("data/make_random_shards.py")
    rng = np.random.default_rng(0)
    for sub, name, n in (("train_varlength", "part_00000_of_00001.hdf5", 40), ("eval_varlength", "part_eval.hdf5", 30)):
        (tmp_path / sub).mkdir()
        write_varlength_shard(tmp_path / sub / name, shards.random_samples(shards.length_mix(5).sample(n, rng), rng))
    return tmp_path


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory) -> Iterator[None]:
    """A one-process group for the module (DDP, the driver's wrappers and `build_run` need one): gloo, and on a
    GPU NCCL for the CUDA tensors."""
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker gets its share of the cores for torch's OpenMP threads, not all of them: four workers
    of two threads each on the 2-core VM kept a thread spinning for a sibling that waited for a core. The
    in-process heavy files (test_checkpoint, test_model, test_last_layer and five more, -n 4) took 73 s and 143
    CPU-s so, 52 s and 94 CPU-s with one thread each. The subprocesses a test starts are not affected: the
    driver sets its own (`bert.dist.env`)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


# The modules on the local Slurm, longest first: wall seconds in the thirty-first session's timeline of the suite
# (docs/journal.md): 169, 57, 53, 29, 20. A module not named here follows them.
SLURM_LONGEST_FIRST = ("test_slurm_resume.py", "test_ps.py", "test_slurm.py", "test_slurm_local.py", "test_hpo.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order in which pytest-xdist hands modules to its workers (scripts/test.sh turns off its own reorder):
    the modules by number of tests, most first, as xdist's reorder has them, with the modules on the local Slurm
    spread evenly through them, longest first. Those take turns on the one node (`one_slurm_module_at_a_time`);
    xdist put them last, as modules of few tests, where they queued behind each other with the other workers
    done: the suite's last 63 s ran on one worker."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slurm = [m for m, its in modules.items() if any(i.get_closest_marker("slurm") for i in its)]
    rank = {name: k for k, name in enumerate(SLURM_LONGEST_FIRST)}
    slurm.sort(key=lambda m: rank.get(Path(m).name, len(rank)))
    order = sorted((m for m in modules if m not in slurm), key=lambda m: -len(modules[m]))
    step = (len(order) + len(slurm)) / max(1, len(slurm))
    for k, module in enumerate(slurm):
        order.insert(round(k * step), module)
    items[:] = [item for module in order for item in modules[module]]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: a second OpenMP thread only waits on its sibling (and spins on a busy machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_slurm_module_at_a_time(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[None]:
    """scripts/test.sh runs two pytest-xdist workers, a module to each (`--dist loadfile`, so a module fixture such
    as test_harness's ten runs is built once). A module with tests on the one local Slurm holds a lock shared by
    the workers until it ends: they share its single node, and test_slurm_local stops and restarts it.
    (xdist's own `--dist loadgroup` ignores its groups under pytest 9.)"""
    if not any(item.get_closest_marker("slurm") for item in request.session.items if item.module is request.module):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """SUITE_CPU_DIR set: each test's CPU seconds, in its own process and in the subprocesses it waited for (the
    driver runs, the bench scripts), appended to a file per worker there; bench/suite_cpu.py sums them. Wall time
    misleads on the 2-core VM, where four workers share two cores."""
    out = os.environ.get("SUITE_CPU_DIR")
    if not out:
        yield
        return
    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    yield
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    own, children = (a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))
    with open(Path(out) / f"worker-{os.getpid()}.tsv", "a") as f:
        f.write(f"{item.nodeid}\t{own:.2f}\t{children:.2f}\n")
