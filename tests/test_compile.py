"""COMPILE (bert.model.compile) and the compile warm-up before run_start (bert.train.warmup).

The compiled model is checked against the eager one on several token counts with one captured graph
(dynamic over T). The CI uses COMPILE=debug (dynamo + AOT autograd, run eagerly): inductor's CPU code
generation takes ~4 minutes for a 1-layer model on the 2-core CI machine; BERT_TEST_INDUCTOR=1 runs the
same check with inductor.
"""

import importlib.util
import json
import os
import subprocess
from dataclasses import replace

import pytest
import torch

from bert.model import BertConfig, BertForPreTraining
from bert.model.compile import COMPILE_MODES, _cxx_compiler, check_compile, compile_model
from bert.model.cudnn_varlen import backward_is_fixed
from bert.synthetic import random_batch
from bert.train.warmup import eval_warmup_batches, warm_up, warmup_batch, warmup_batches

CPU = torch.device("cpu")
LENGTH_SETS = [(37, 5, 128, 2), (64, 9, 33, 100), (12, 300, 7, 40)]  # same B, different T and M


def small_config(layers: int = 1, dropout: float = 0.0) -> BertConfig:
    cfg = replace(BertConfig.load("tiny"), vocab_size=2000, real_vocab_size=1998, num_hidden_layers=layers)
    return cfg.with_dropout(dropout)


def batch(i: int):
    return random_batch(LENGTH_SETS[i % len(LENGTH_SETS)], seed=i, vocab_size=1998)


def loss_and_grads(model, b):
    model.zero_grad(set_to_none=True)
    out = model(b)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compile_that_cannot_run_here_is_one_line_naming_the_setting(monkeypatch):
    check_compile("off", CPU)
    check_compile("debug", CPU)
    with pytest.raises(ValueError, match=r"^COMPILE=reduce-overhead captures CUDA graphs and needs a CUDA device"):
        check_compile("reduce-overhead", CPU)
    with pytest.raises(ValueError, match="COMPILE='fast' is not one of off, default"):
        check_compile("fast", CPU)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ValueError, match=r"^COMPILE=default on the CPU needs a C\+\+ compiler") as e:
        check_compile("default", CPU)
    assert "\n" not in str(e.value)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"^COMPILE=max-autotune on CUDA needs Triton"):
        check_compile("max-autotune", torch.device("cuda"))
    # with a C++ compiler the CPU runs every inductor mode but the one that only records CUDA graphs (max-autotune
    # records them on CUDA alone: on the CPU it is inductor's autotuning)
    monkeypatch.setattr("bert.model.compile._cxx_compiler", lambda: "/usr/bin/g++")
    for name in ("default", "max-autotune", "max-autotune-no-cudagraphs"):
        check_compile(name, CPU)
    with pytest.raises(ValueError, match=r"^COMPILE=reduce-overhead captures CUDA graphs"):
        check_compile("reduce-overhead", CPU)


def test_warm_up_leaves_training_bit_identical():
    """Warm-up (forward and backward with dropout) then a training step == the same step without it."""
    def trained(warm: bool):
        torch.manual_seed(0)
        model = BertForPreTraining(small_config(layers=2, dropout=0.1), attention="loop")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if warm:
            no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
            assert warm_up(model.eval(), warmup_batch(4, 64, CPU, vocab_size=1998), no_autocast) > 0
            assert model.training is False  # the mode is restored
            assert all(p.grad is None for p in model.parameters())  # no gradient left to leak into step 1
            model.train()
        for i in range(2):
            optimizer.zero_grad(set_to_none=True)
            model(batch(i)).loss.backward()
            optimizer.step()
        return model.state_dict(), torch.get_rng_state()

    (cold, cold_rng), (warm, warm_rng) = trained(False), trained(True)
    assert torch.equal(cold_rng, warm_rng)
    for name in cold:
        assert torch.equal(cold[name], warm[name]), name


def test_warm_up_batch_has_two_sequences_at_least_of_two_tokens_or_more():
    """Sizes 0 and 1 are specialised on by a dynamic graph: a warm-up on them would leave the graph the training
    steps need uncompiled (TRAIN_BATCHSIZE=1 included)."""
    for sequences in (1, 2, 5):
        b = warmup_batch(sequences, 8, CPU, vocab_size=1998, seed=sequences)
        assert b.num_sequences == max(sequences, 2)
        assert all(2 <= n <= 8 for n in b.seq.lengths), b.seq.lengths


def compiled_equals_eager(name: str, atol: float, scope: str = "model", layers: int = 1) -> None:
    torch.manual_seed(0)
    eager = BertForPreTraining(small_config(layers), attention="loop")
    compiled = BertForPreTraining(small_config(layers), attention="loop")
    compiled.load_state_dict(eager.state_dict())
    assert compile_model(compiled, name, CPU, scope) is compiled  # in place: names and type unchanged
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for i in range(len(LENGTH_SETS)):
        want_loss, want_grads = loss_and_grads(eager, batch(i))
        got_loss, got_grads = loss_and_grads(compiled, batch(i))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=atol)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=atol)
    # the graphs of the first batch serve every token count: dynamic over T (and M), no recompilation. The model:
    # two graphs (the attention planner is host work, left out of the graph); per layer: the embeddings, one
    # encoder layer's graph that every layer but the last runs, the last layer's (it keeps the [CLS] and masked
    # rows after attention, bert.model.last_layer; with one layer, the only one) and the heads
    assert graphs == [2 if scope == "model" else 2 + min(layers, 2)] * len(LENGTH_SETS)


@pytest.mark.slow
@pytest.mark.parametrize("scope, layers", [("model", 1), ("layers", 3)])
def test_compiled_equals_eager_on_every_token_count(scope, layers):
    compiled_equals_eager("debug", atol=0, scope=scope, layers=layers)


def backward_order(scope: str, buckets: str, warm_world: int | None = None, fp8: bool = False) -> str:
    """The second backward of a 2-layer tiny BERT compiled with COMPILE=debug at `scope` under the driver's wrapper
    `buckets` (world of one, 1 MB buckets: several): the order in which the compiled backward functions run (C)
    and the comm hook receives buckets (B). `warm_world`: compiled first by the driver's warm-up, as a run of that
    many ranks makes it (`training_entry`). `fp8`: the encoder's linears swapped for torchao's (emulated)."""
    from types import SimpleNamespace

    from bert.config import DistConfig
    from bert.dist.ddp import apply_ddp
    from bert.train.warmup import training_entry

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = BertForPreTraining(small_config(layers=2), attention="loop")
    if fp8:
        from bert.model.fp8 import convert_to_fp8

        convert_to_fp8(model, emulate=True)
    model = compile_model(model, "debug", CPU, scope)
    wrapper = apply_ddp(model, DistConfig(bucket_cap_mb=1.0, grad_buckets=buckets))
    events: list[str] = []

    def hook(state, bucket):
        events.append("B")
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    wrapper.register_comm_hook(None, hook)
    if warm_world is not None:
        run = SimpleNamespace(ddp=wrapper, env=SimpleNamespace(world_size=warm_world),
                              cfg=SimpleNamespace(model=SimpleNamespace(compile_scope=scope)))
        warm_up(training_entry(run), batch(2), lambda: torch.autocast("cpu", enabled=False))
        assert events == [] and all(p.grad is None for p in model.parameters())  # no_sync: no hook, no trace left
    wrapper(batch(0)).loss.backward()  # the first backward: DDP starts with one bucket, then rebuilds them
    wrapper.zero_grad(set_to_none=True)
    events.clear()
    loss = wrapper(batch(1)).loss
    seen, stack = set(), [loss.grad_fn]
    while stack:  # every compiled backward function of this graph logs when it starts
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            node.register_prehook(lambda *_: events.append("C"))
        stack.extend(f for f, _ in node.next_functions)
    loss.backward()
    return "".join(events)


@pytest.mark.slow
@pytest.mark.parametrize("scope, buckets", [("model", "ddp"), ("layers", "ddp"), ("layers", "balanced"),
                                            ("model", "balanced")])
def test_gradients_are_handed_over_while_the_compiled_backward_runs(world_of_one, scope, buckets):
    """Overlap needs a bucket handed to the comm hook before the backward has finished: DDP gets it from dynamo's
    DDPOptimizer (one graph cut at bucket boundaries), balanced buffers only from per-layer graphs; one graph for
    the model under balanced buffers hands everything over at the end, which is why the config refuses it."""
    order = backward_order(scope, buckets)
    assert order.count("B") >= 3, order
    overlapped = "C" in order[order.index("B"):]
    assert overlapped == (scope == "layers" or buckets == "ddp"), order


@pytest.mark.slow
@pytest.mark.parametrize("world, overlapped", [(2, True), (1, False)])
def test_the_warm_up_compiles_inside_ddp_when_there_is_an_all_reduce_to_overlap(world_of_one, world, overlapped):
    """The timed steps reuse the graph the warm-up compiled, and dynamo cuts it at DDP's buckets only when it compiles
    inside DDP's forward: compiled on the bare model, the whole backward runs before the first bucket is handed over.
    With several ranks the warm-up goes through DDP; alone, through the bare model (one graph fuses more)."""
    order = backward_order("model", "ddp", warm_world=world)
    assert order.count("B") >= 3, order
    assert ("C" in order[order.index("B"):]) == overlapped, order


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (not in the CPU "
                    "install; scripts/test_torch.sh adds it)")
def test_float8_linears_compile_inside_ddp_and_are_cut_at_its_buckets(world_of_one):
    """PRECISION=fp8 on several GPUs compiles inside DDP's forward, where dynamo's DDPOptimizer cuts the graph with
    torchao's float8 tensors in it: reported broken for an HF model (pytorch/ao#2586, pytorch/pytorch#158936). Ours
    compiles there under torch 2.11 + torchao 0.18 and the all-reduce still overlaps the backward."""
    order = backward_order("model", "ddp", warm_world=2, fp8=True)
    assert order.count("B") >= 3 and "C" in order[order.index("B"):], order


def test_per_layer_graphs_are_warmed_up_on_the_bare_model_at_any_world_size():
    """COMPILE_SCOPE=layers hands gradients over layer by layer without DDP's cuts, which would split each layer."""
    from types import SimpleNamespace

    from bert.train.warmup import training_entry

    wrapper = SimpleNamespace(module=object())
    for scope, world, entry in [("layers", 8, wrapper.module), ("layers", 1, wrapper.module), ("model", 8, wrapper),
                                ("model", 1, wrapper.module)]:
        run = SimpleNamespace(ddp=wrapper, env=SimpleNamespace(world_size=world),
                              cfg=SimpleNamespace(model=SimpleNamespace(compile_scope=scope)))
        assert training_entry(run) is entry, (scope, world)


def test_one_graph_for_the_model_is_refused_with_balanced_buffers():
    from bert.config import ConfigError, from_flat

    def cfg(**kw):
        return from_flat(input_dir="d", eval_dir="e", train_batch_size=16, bert_config_path="tiny", max_steps=10,
                         learning_rate=1e-3, grad_buckets="balanced", **kw)

    with pytest.raises(ConfigError, match="COMPILE_SCOPE.*GRAD_BUCKETS=balanced.*set COMPILE_SCOPE=layers"):
        cfg(compile="debug").validate()
    cfg(compile="debug", compile_scope="layers").validate()
    cfg().validate()  # not compiled: nothing to cut
    with pytest.raises(ConfigError, match="COMPILE_SCOPE.*must be one of model, layers"):
        cfg(compile="debug", compile_scope="layer").validate()


@pytest.mark.parametrize("graphs", ["reduce-overhead", "max-autotune"])
def test_what_cuda_graphs_cannot_serve_is_refused_at_parse_time(graphs):
    """Gradient accumulation (a micro-step's .grad lives in the graph pool and the next replay overwrites it) and graphs
    per layer (each call of a layer in the eval forward frees the previous one's output)."""
    from bert.config import ConfigError, from_flat

    def cfg(**kw):
        return from_flat(input_dir="d", eval_dir="e", train_batch_size=16, bert_config_path="tiny", max_steps=10,
                         learning_rate=1e-3, **kw)

    with pytest.raises(ConfigError, match=f"GRADIENT_STEPS.*COMPILE={graphs}.*use COMPILE=default"):
        cfg(compile=graphs, gradient_accumulation_steps=2).validate()
    with pytest.raises(ConfigError, match=f"COMPILE_SCOPE.*COMPILE={graphs}.*set COMPILE_SCOPE=model"):
        cfg(compile=graphs, compile_scope="layers").validate()
    cfg(compile=graphs, static_tokens=4096).validate()  # split into padding sequences of at most 512 tokens
    # without CUDA graphs each of them runs
    cfg(compile="default", gradient_accumulation_steps=2, compile_scope="layers", static_tokens=1024).validate()


@pytest.mark.skipif(not os.environ.get("BERT_TEST_INDUCTOR"), reason="set BERT_TEST_INDUCTOR=1 (~4 min on 2 cores)")
@pytest.mark.skipif(_cxx_compiler() is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_compiled_equals_eager_on_every_token_count():
    assert COMPILE_MODES["default"] == ("inductor", "default")
    compiled_equals_eager("default", atol=1e-5)


@pytest.mark.slow
def test_driver_compiles_before_run_start_and_trains_on_static_shapes(tmp_path, synthetic_data):
    """One rank, COMPILE=debug and STATIC_TOKENS=128: the compile time is printed and logged inside the
    untimed init, the run trains on padded batches and evaluates, and the official checker accepts the log. With
    COMPILE_CACHE the file is read before the warm-up compiles and written after it (tests/test_compile_cache.py:
    COMPILE=debug runs its graphs eagerly, so there is nothing to write)."""
    from test_train import PY, ROOT, checker, common_args, free_port, mllog

    out = tmp_path / "run"
    args = common_args(synthetic_data, out, train_batch_size=8, learning_rate=1e-3, max_steps=4,
                       eval_iter_samples=32, num_eval_examples=32, eval_batch_size=32, compile="debug",
                       static_tokens=128, skip_checkpoint=1, compile_cache=tmp_path / "cache.bin")
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


def test_warm_up_compiles_the_eval_too_and_reads_no_sample_before_run_start(world_of_one, tmp_path, monkeypatch):
    """The driver's build and compile warm-up (COMPILE=debug; 10 eval examples in batches of 4: sizes 4, 4, 2) read
    no sample: the rules' clock starts before any part of the system touches the dataset (bert.data.eval_set).
    After run_start the first evaluation reads the eval set once and compiles nothing (before the eval warm-up it
    compiled the whole forward again: grad mode and the training flag are guarded), and neither does a training
    step or a second evaluation."""
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
    settings = dict(compile="debug", num_eval_examples=10, eval_iter_start_samples=16)  # an eval within 4 steps
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, static", [("default", 0), ("reduce-overhead", 512)])
@pytest.mark.parametrize("attention", ["varlen", pytest.param("cudnn", marks=pytest.mark.skipif(
    not backward_is_fixed(), reason="cuDNN ragged backward of torch < 2.14 (pytorch#186142)"))])
def test_cuda_compiled_equals_eager_in_bf16(name, static, attention):
    """BERT-tiny with flash varlen (or cuDNN's ragged attention, a custom op) under bf16 autocast: compiled (with
    CUDA graphs for reduce-overhead, on static shapes) against the same model in fp32, on several token counts.
    Both bf16 runs round; the compiled one may round differently (inductor fuses casts away) but must be no further
    from fp32 than twice eager's distance (plus 0.1 %): on the H100 a fixed 5 % bound on compiled vs eager failed
    by rounding alone (6 % on one small gradient)."""
    from bert.static_shapes import MASKED_BUCKET, pad_to_buckets

    cuda = torch.device("cuda")
    torch.manual_seed(0)
    eager = BertForPreTraining(small_config(layers=2), attention=attention, device=cuda).to(cuda)
    compiled = BertForPreTraining(small_config(layers=2), attention=attention, device=cuda).to(cuda)
    reference = BertForPreTraining(small_config(layers=2), attention="loop", device=cuda).to(cuda)  # fp32
    compiled.load_state_dict(eager.state_dict())
    reference.load_state_dict(eager.state_dict())
    compile_model(compiled, name, cuda)
    for i in range(2 * len(LENGTH_SETS)):  # every shape twice: CUDA graphs record, then replay
        b = batch(i).to(cuda)
        if static:
            b = pad_to_buckets(b, static, MASKED_BUCKET)
        _, ref_grads = loss_and_grads(reference, b)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want_loss, want_grads = loss_and_grads(eager, b)
            got_loss, got_grads = loss_and_grads(compiled, b)
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=2e-2)
        for g, w, r in zip(got_grads, want_grads, ref_grads):
            assert (g - r).norm() <= 2 * (w - r).norm() + 1e-3 * r.norm() + 1e-6


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


def test_the_warm_up_batch_has_no_size_a_first_trace_would_take_for_a_constant():
    """A warm-up batch with as many masked rows as the hidden size made the heads' graph static in the masked count:
    the first training step after run_start compiled it again (seen on the CPU, COMPILE=default, SEED=20504). The
    warm-up draws again when a size coincides with the model's dimensions (`model_sizes`) or another size."""
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

    def graphs_after_a_training_step(warm) -> int:
        torch.manual_seed(0)
        model = BertForPreTraining(CFG, attention="loop")
        compile_model(model, "debug", CPU)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        warm_up(model, warm, lambda: torch.autocast("cpu", enabled=False))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model(later).loss.backward()
        return torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs

    assert graphs_after_a_training_step(plain) == 1  # the heads' graph, again, as in the timed run
    assert graphs_after_a_training_step(chosen) == 0
