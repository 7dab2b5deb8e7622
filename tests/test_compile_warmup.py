"""The compile warm-up before run_start (bert.train.warmup) through the driver and its eval and CUDA-graph shapes.

Split from tests/test_compile.py (the model's compile and the warm-up's own batches), so that the two files' minutes
run on two test workers. COMPILE=debug throughout, as there.
"""

import json
import subprocess

import pytest
import torch
from test_compile import CPU

from bert.model import BertConfig, BertForPreTraining
from bert.model.compile import compile_model
from bert.synthetic import random_batch
from bert.train.warmup import eval_warmup_batches, warm_up, warmup_batch, warmup_batches


@pytest.mark.slow
def test_driver_compiles_before_run_start_and_trains_on_static_shapes(tmp_path, synthetic_data):
    """One rank, COMPILE=debug and STATIC_TOKENS=128: the compile time is printed and logged inside the
    untimed init, the run trains on padded batches and evaluates, and the official checker accepts the log. With
    COMPILE_CACHE the file is read before the warm-up compiles and written after it (tests/test_compile_cache.py:
    COMPILE=debug runs its graphs eagerly, so there is nothing to write). BERT-tiny with one layer: what is checked
    is the driver's order of events, and a second layer was about a quarter of the run's CPU time, in tracing."""
    from dataclasses import replace

    from ports import free_port
    from test_train import PY, ROOT, checker, common_args, mllog

    out = tmp_path / "run"
    one_layer = tmp_path / "bert_config.json"
    one_layer.write_text(json.dumps(replace(BertConfig.load("tiny"), num_hidden_layers=1).to_dict()))
    args = common_args(synthetic_data, out, train_batch_size=8, learning_rate=1e-3, max_steps=4,
                       eval_iter_samples=32, num_eval_examples=32, eval_batch_size=32, compile="debug",
                       static_tokens=128, skip_checkpoint=1, compile_cache=tmp_path / "cache.bin",
                       bert_config_path=one_layer)
    run = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                          str(free_port()), str(ROOT / "run_pretraining.py"), *args],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode in (0, 1), run.stderr[-3000:]  # 1: max_steps before the target (aborted)
    assert run.stdout.count("compile: COMPILE=debug: first forward+backward took") == 1
    order = [run.stdout.index(line) for line in ("compile cache: " + str(tmp_path / "cache.bin") + " does not exist",
                                                 "compile: COMPILE=debug", "compile cache: nothing to write")]
    assert order == sorted(order) and not (tmp_path / "cache.bin").exists()
    keys = [e["key"] for e in mllog(out / "result_0.txt")]
    assert keys.index("init_start") < keys.index("model_compile_seconds") < keys.index("init_stop")
    assert "eval_accuracy" in keys and "run_stop" in keys
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "compiled_after_run_start" in r] == [{"compiled_after_run_start": {}}]
    cc = checker(out / "result_0.txt", tmp_path)
    assert cc.returncode == 0, cc.stdout + cc.stderr


def test_a_compile_that_fails_leaves_the_keys_it_looked_up_beside_the_cache(tmp_path, monkeypatch):
    """The driver passes COMPILE_CACHE to recording_keys, so each key is on disk as it comes: a compile that raises
    (or is killed by a deadline) never reaches save_keys, and its keys are what says why a carried cache missed."""
    import logging
    from types import SimpleNamespace

    from bert.train import warmup
    from bert.train.compile_cache import keys_path

    cache = tmp_path / "bert.bin.gz"
    run = SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(compile="default", compile_cache=str(cache))),
                          env=SimpleNamespace(is_main=True))

    def failing(run, log, device):
        logging.getLogger("torch._inductor.codecache").debug("FX graph cache hash details for key f1:\n[h1] gm: g")
        raise RuntimeError("inductor failed")

    monkeypatch.setattr(warmup, "_compile", failing)
    with pytest.raises(RuntimeError, match="inductor failed"):
        warmup.compile_before_run(run, None, CPU)
    assert json.loads(keys_path(str(cache)).read_text())["inductor"] == {"f1": ["[h1] gm: g"]}
    assert not cache.exists()


def test_warm_up_compiles_the_eval_too_and_reads_no_sample_before_run_start(world_of_one, tmp_path, monkeypatch):
    """The driver's build and compile warm-up (COMPILE=debug; 10 eval examples in batches of 4: sizes 4, 4, 2) read
    no sample: the rules' clock starts before any part of the system touches the dataset (bert.data.eval_set).
    After run_start the first evaluation reads the eval set once and compiles nothing (before the eval warm-up it
    compiled the whole forward again: grad mode and the training flag are guarded), and neither does a training
    step or a second evaluation. Training batches of 2 sequences, not 4: the CPU's `loop` attention traces one
    SDPA per sequence, and what is checked here does not depend on how many there are."""
    from script_modules import load_script
    from torch._dynamo.utils import counters

    from bert.data.reader import SampleReader
    from bert.train.evaluate import evaluate
    from bert.train.loop import train_step
    from bert.train.mlperf_log import MLPerfLog
    from bert.train.warmup import compile_before_run

    hs = load_script("bench/host_syncs.py")
    data = hs.write_random_shards(tmp_path / "data", eval_samples=10)
    reads: list[int] = []
    read = SampleReader.read
    monkeypatch.setattr(SampleReader, "read", lambda self, ids: reads.append(len(ids)) or read(self, ids))
    torch._dynamo.reset()
    settings = dict(compile="debug", num_eval_examples=10, train_batch_size=2,
                    eval_iter_start_samples=8)  # an eval within 4 steps
    run = hs.build(hs.config(data, tmp_path / "out", settings, max_steps=4))
    assert run.eval_set.batch_sizes == [4, 4, 2] and run.eval_samples == 10
    compile_before_run(run, MLPerfLog("", enabled=False), CPU)
    assert reads == [] and not run.eval_set.loaded
    graphs = counters["stats"]["unique_graphs"]
    evaluate(run.ddp.module, run.eval_set, run.autocast())
    assert sorted(reads) == [2, 4, 4] and counters["stats"]["unique_graphs"] == graphs
    try:
        train_step(run, iter(run.loader))
    finally:
        run.loader.close()  # its thread read the training batches
    before = len(reads)
    evaluate(run.ddp.module, run.eval_set, run.autocast())
    assert len(reads) == before  # kept from the first evaluation
    assert counters["stats"]["unique_graphs"] == graphs


def test_cuda_graph_warm_up_runs_one_batch_per_likely_token_bucket():
    """Under a CUDA-graph COMPILE mode with STATIC_TOKENS the warm-up covers every bucket `likely_token_buckets`
    names (each then recorded before run_start); other modes warm up on one batch."""
    from types import SimpleNamespace

    import numpy as np

    from bert.config import from_flat
    from bert.lengths import WIKI_PHASE2
    from bert.static_shapes import likely_token_buckets

    lengths = WIKI_PHASE2.sample(20_000, np.random.default_rng(0))
    module = SimpleNamespace(config=BertConfig.load("tiny"))

    def batches(compile_mode: str, static: int) -> list:
        cfg = from_flat(input_dir="d", eval_dir="e", train_batch_size=16, bert_config_path="tiny", max_steps=10,
                        learning_rate=1e-3, compile=compile_mode, static_tokens=static)
        run = SimpleNamespace(cfg=cfg, ddp=SimpleNamespace(module=module), loader=SimpleNamespace(
            sample_lengths=lengths))
        return warmup_batches(run, CPU)

    graphs = batches("reduce-overhead", 512)
    assert [b.num_tokens for b in graphs] == likely_token_buckets(lengths, 16, 512) and len(graphs) > 3
    assert all(b.num_sequences == 17 for b in graphs)
    assert len(batches("default", 512)) == 1 and len(batches("reduce-overhead", 0)) == 1


def test_cuda_graph_warm_up_runs_every_padded_eval_shape(tmp_path):
    """With STATIC_TOKENS the eval batches are padded like the training batches, and under a CUDA-graph COMPILE mode
    the eval warm-up's synthetic batches take exactly their shapes (tokens, masked rows, sequences, max_seqlen),
    known from the length index before a sample is read: the first evaluation records no graph. Other modes: one
    batch per eval batch size, with the padding sequence the eval batches have. The eval's bucket is its own
    (STATIC_TOKENS capped at one sequence, as the driver builds the eval set), not the training batches'."""
    from types import SimpleNamespace

    from script_modules import load_script

    from bert.config import from_flat
    from bert.data.eval_set import EvalSet
    from bert.static_shapes import eval_token_bucket
    from bert.train.loop import TrainState

    data = load_script("bench/host_syncs.py").write_random_shards(tmp_path, eval_samples=60)
    module = SimpleNamespace(config=BertConfig.load(str(data / "bert_config.json")))

    def shape(b) -> tuple[int, int, int, int]:
        return b.num_tokens, b.masked_labels.numel(), b.num_sequences, b.seq.max_seqlen

    def warm(compile_mode: str, static: int = 256) -> tuple[list, EvalSet]:
        cfg = from_flat(input_dir="d", eval_dir="e", train_batch_size=8, eval_batch_size=8, bert_config_path="tiny",
                        max_steps=10, learning_rate=1e-3, compile=compile_mode, static_tokens=static,
                        eval_iter_samples=40)
        evals = EvalSet(data / "eval_varlength", 8, 1, 0, 60, static_tokens=eval_token_bucket(static))
        run = SimpleNamespace(cfg=cfg, ddp=SimpleNamespace(module=module), eval_set=evals, state=TrainState(),
                              global_batch_size=8)
        return eval_warmup_batches(run, CPU), evals

    graphs, evals = warm("reduce-overhead")
    assert not evals.loaded  # the shapes came from the length index
    real = [shape(b) for b in evals]
    assert all(t % 256 == 0 for t, *_ in real) and len(set(real)) > 2
    assert sorted(shape(b) for b in graphs) == sorted(set(real))
    dynamic, evals = warm("default")
    assert sorted(b.num_sequences for b in dynamic) == sorted({s for _, _, s, _ in real}) == [5, 9]  # 7 x 8 + 4
    # STATIC_TOKENS=1024: training batches in 1024-token buckets, the eval's in 512-token ones
    graphs, evals = warm("reduce-overhead", 1024)
    real = [shape(b) for b in evals]
    assert all(t % 512 == 0 for t, *_ in real) and any(t % 1024 for t, *_ in real)
    assert sorted(shape(b) for b in graphs) == sorted(set(real))
    dynamic, _ = warm("default", 1024)
    assert all(b.num_tokens == -(-(sum(b.seq.lengths[:-1]) + 1) // 512) * 512 for b in dynamic)


@pytest.mark.parametrize("start, limit, evaluates", [(80, 10**9, True), (88, 10**9, False), (80, 72, False),
                                                     (0, 10**9, False)])
def test_a_run_that_cannot_reach_an_evaluation_compiles_no_eval_graph(tmp_path, start, limit, evaluates):
    """bench/train_gpu.py sets the first evaluation out of reach: its compiled drivers skip the eval warm-up (a whole
    inference compile). 10 steps of 8 sequences: an evaluation at sample 80 is reached (the loop evaluates before it
    checks its limits), at 88 not, nor at 80 when MAX_SAMPLES_TERMINATION=72 stops the run at step 9; 0 is the
    rules' interval for a batch of 8 (over 150,000 samples)."""
    from types import SimpleNamespace

    from script_modules import load_script

    from bert.config import from_flat
    from bert.data.eval_set import EvalSet
    from bert.train.loop import TrainState

    data = load_script("bench/host_syncs.py").write_random_shards(tmp_path, eval_samples=20)
    cfg = from_flat(input_dir="d", eval_dir="e", train_batch_size=8, eval_batch_size=8, bert_config_path="tiny",
                    max_steps=10, learning_rate=1e-3, compile="default", eval_iter_start_samples=start,
                    max_samples_termination=limit)
    run = SimpleNamespace(cfg=cfg, ddp=SimpleNamespace(module=SimpleNamespace(config=BertConfig.load(
        str(data / "bert_config.json")))), eval_set=EvalSet(data / "eval_varlength", 8, 1, 0, 20),
        state=TrainState(), global_batch_size=8)
    assert bool(eval_warmup_batches(run, CPU)) == evaluates


def test_what_compiles_after_run_start_is_reported(tmp_path):
    """The driver's closing record (bert.train.warmup.CompileWatch): `{}` when the warm-up compiled every graph,
    the moved counters when a graph compiled inside the timed run, everything when dynamo was first imported after
    run_start, and no record for a run that compiles nothing (COMPILE=off, COMPILE_OPTIMIZER=0)."""
    from bert.config import from_flat
    from bert.train import warmup
    from bert.train.progress import Progress

    def records(compile: str = "debug", dynamo_at_start: bool = True, during=None) -> list[dict]:
        progress = Progress(tmp_path, enabled=True)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=True)
        f(torch.ones(3))
        with pytest.MonkeyPatch.context() as mp:
            if not dynamo_at_start:
                mp.setattr(warmup, "compile_counters", lambda: None)
            watch = warmup.CompileWatch(from_flat(bert_config_path="tiny", compile=compile))
        f(torch.ones(5))  # the same graph
        if during is not None:
            torch.compile(during, backend="eager")(torch.ones(4))
        watch.report(progress)
        progress.close()
        return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    assert records() == [{"compiled_after_run_start": {}}]
    moved = records(during=lambda x: x.sin())[0]["compiled_after_run_start"]
    assert moved["stats"]["unique_graphs"] == 1
    assert records(dynamo_at_start=False)[0]["compiled_after_run_start"]["stats"]["unique_graphs"] == 1
    assert records(compile="off", during=lambda x: x.cos()) == []


def graphs_after_a_training_step(cfg: BertConfig, scope: str, warm, later) -> int:
    """New dynamo graphs in a training step on `later` after the warm-up on `warm` (COMPILE=debug, padded
    attention, compiled at `scope`): a graph compiled inside the timed run."""
    torch.manual_seed(0)
    model = compile_model(BertForPreTraining(cfg, attention="padded"), "debug", CPU, scope)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    warm_up(model, warm, lambda: torch.autocast("cpu", enabled=False))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model(later).loss.backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


def test_a_warm_up_batch_whose_longest_sequence_is_the_hidden_size_is_drawn_again():
    """Per-layer graphs with padded attention take the key mask's width, the batch's longest sequence, as an input:
    a warm-up batch whose longest sequence was the hidden size made the layers' graph static in it, and the first
    training step after run_start compiled it again. Model scope builds the mask inside its one graph (not
    affected)."""
    from dataclasses import replace

    from test_last_layer import CFG

    from bert.train.warmup import coincides, model_sizes

    cfg = replace(CFG, num_hidden_layers=1)
    avoid = model_sizes(cfg)
    wide = random_batch((cfg.hidden_size, 20, 25, 30, 12, 18, 22, 9), seed=0, vocab_size=cfg.real_vocab_size)
    narrow = random_batch((cfg.hidden_size - 1, 20, 25, 30, 12, 18, 22, 9), seed=0, vocab_size=cfg.real_vocab_size)
    assert coincides(wide, avoid) and not coincides(narrow, avoid)  # their other sizes are clear
    later = random_batch((30, 70, 55, 90, 44, 20, 33, 61), seed=5, vocab_size=cfg.real_vocab_size)
    assert graphs_after_a_training_step(cfg, "layers", wide, later) == 1  # the layer's graph, again
    assert graphs_after_a_training_step(cfg, "layers", narrow, later) == 0


def test_the_warm_up_batch_has_no_size_a_first_trace_would_take_for_a_constant():
    """A warm-up batch with as many masked rows as the hidden size made the heads' graph static in the masked count:
    the first training step after run_start compiled it again (seen on the CPU, COMPILE=default, SEED=20504). The
    warm-up draws again when a size coincides with the model's dimensions (`model_sizes`) or another size."""
    from dataclasses import replace

    from test_last_layer import CFG

    from bert.train.warmup import coincides, model_sizes

    avoid = model_sizes(CFG)
    assert {CFG.hidden_size, CFG.intermediate_size, CFG.vocab_size, 8} <= avoid  # 8: the head size
    seed = 21  # its first draw: 4 sequences, 32 masked rows, CFG's hidden size
    plain = warmup_batch(4, 100, CPU, CFG.real_vocab_size, seed=seed)
    assert plain.masked_positions.numel() == CFG.hidden_size and coincides(plain, avoid)
    chosen = warmup_batch(4, 100, CPU, CFG.real_vocab_size, seed=seed, avoid=avoid)
    assert not coincides(chosen, avoid) and chosen.num_sequences == 4
    later = random_batch((30, 70, 55, 90), seed=5, vocab_size=CFG.real_vocab_size)
    assert not coincides(later, avoid)
    # the heads' sizes are the point: the cheapest trace, padded attention and one layer (no `model_sizes` entry)
    one_layer = replace(CFG, num_hidden_layers=1)
    assert graphs_after_a_training_step(one_layer, "model", plain, later) == 1  # the heads' graph, again
    assert graphs_after_a_training_step(one_layer, "model", chosen, later) == 0
