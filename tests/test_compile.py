"""COMPILE (bert.model.compile) and the compile warm-up's own batches (bert.train.warmup; through the driver:
tests/test_compile_warmup.py).

The compiled model is checked against the eager one on several token counts with one captured graph
(dynamic over T). The CI uses COMPILE=debug (dynamo + AOT autograd, run eagerly): inductor's CPU code
generation takes ~4 minutes for a 1-layer model on the 2-core CI machine; BERT_TEST_INDUCTOR=1 runs the
same check with inductor.
"""

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from bert.model import BertConfig, BertForPreTraining
from bert.model.compile import COMPILE_MODES, _cxx_compiler, check_compile, compile_model
from bert.model.cudnn_varlen import backward_is_fixed
from bert.synthetic import random_batch
from bert.train.warmup import warm_up, warmup_batch

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
    many ranks makes it (`training_entry`). `fp8`: the encoder's linears swapped for torchao's (emulated).
    Where the graphs are cut is the point, not the attention kernel: one graph for the model traces padded
    attention (one SDPA per layer) in about two thirds of the time of `loop` (one per sequence). Per layer, the
    padded layout's key mask enters every layer's graph, and batch 0's width, 128, is the hidden size: a first
    trace takes it for a constant and batch 1 recompiles, which costs more than `loop` saves."""
    from types import SimpleNamespace

    from bert.config import DistConfig
    from bert.dist.ddp import apply_ddp
    from bert.train.warmup import training_entry

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = BertForPreTraining(small_config(layers=2), attention="padded" if scope == "model" else "loop")
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


@pytest.mark.skipif(_cxx_compiler() is None, reason="inductor on the CPU needs a C++ compiler")
def test_combo_kernels_are_inductors_setting_for_the_graphs_compiled_after():
    """COMBO_KERNELS reaches inductor when the model is compiled (bert.model.compile.configure_inductor), on or off
    as the config says, so the update compiled after it gets the same; COMPILE=off sets nothing."""
    # inductor's own patch restores the setting after (monkeypatch's undo deletes it from torch's config module,
    # which then hides it from every later compile in the process)
    with torch._inductor.config.patch(combo_kernels=False):
        model = BertForPreTraining(small_config(), attention="loop", device=CPU)
        compile_model(model, "off", CPU, combo_kernels=True)
        assert torch._inductor.config.combo_kernels is False
        compile_model(model, "default", CPU, combo_kernels=True)
        assert torch._inductor.config.combo_kernels is True
        compile_model(BertForPreTraining(small_config(), attention="loop", device=CPU), "default", CPU)
        assert torch._inductor.config.combo_kernels is False
    assert torch._inductor.config.combo_kernels is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("settings", [
    {"precision": "bf16"},
    {"precision": "fp8", "fp8_recipe": "delayed", "attention": "triton", "residual_norm": "fused-lean",
     "bias_gelu": "fused"}], ids=["bf16", "fp8-candidate"])
def test_cuda_combo_kernels_change_no_result(settings):
    """The driver's model (bf16 with fp32 masters, and the float8 candidate) and its compiled LAMB update, compiled
    with COMBO_KERNELS=1, give the loss and gradients they give without (the same kernels' work, launched
    together), over two steps: the second step's weights come from the first's update and its float8 scales from
    the first step's recorded amaxes."""
    from bert.config import from_flat
    from bert.optim import build_optimizer
    from bert.optim.compiled import compile_step
    from bert.static_shapes import MASKED_BUCKET, pad_to_buckets
    from bert.train.build import build_model

    cuda = torch.device("cuda")
    results = []
    with torch._inductor.config.patch(combo_kernels=False):  # restored after (not monkeypatch: it deletes it)
        for combo in (False, True):
            torch._dynamo.reset()
            cfg = from_flat(bert_config_path="tiny", compile="default", combo_kernels=combo, static_tokens=512,
                            master_weights=True, learning_rate=1e-3, max_steps=100, compile_optimizer=True,
                            **settings)
            torch.manual_seed(0)
            model = build_model(cfg.model, cuda)
            optimizer = compile_step(build_optimizer(model, cfg.optim, torch.bfloat16), cfg.model.compile)
            steps = []
            for i in range(2):
                torch.manual_seed(10 + i)  # the dropout seeds: the same both sides
                steps.append(loss_and_grads(model, pad_to_buckets(batch(i), 512, MASKED_BUCKET).to(cuda)))
                optimizer.step()
            results.append(steps)
    for (loss, grads), (combo_loss, combo_grads) in zip(*results):
        torch.testing.assert_close(combo_loss, loss, rtol=1e-3, atol=1e-4)
        for g, w in zip(combo_grads, grads):
            assert (g.float() - w.float()).norm() <= 1e-3 * w.float().norm() + 1e-6
