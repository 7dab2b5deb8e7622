"""`ATTENTION=triton`'s tile shapes timed on a GPU beside torch's FlashAttention-2, at one BERT-large layer's attention.

The kernels' tiles (bert.model.triton_attention: FORWARD_TILE, BACKWARD_TILE) were chosen from their sm_90 machine code
(bench/attention_sass.py), not from timings. This times each candidate (BM, BN, warps) on one batch of the phase-2
length mix (96 sequences, 16 heads of 64, bf16, dropout 0.1), one kernel's tile varied at a time (the others at
their defaults), and the best of each kernel together, beside FlashAttention-2 (`bert::flash_varlen`, what
`ATTENTION=varlen` runs) on the same tokens. Each candidate's results are checked against the default tiles': the same
mask bits (the mask does not depend on the tiles), the output, log-sum-exp and gradients within bf16's rounding of a
different summation order. A candidate that fails to compile or run becomes a row with its error.

Times are medians over `--repeats` samples of `--calls` (10) calls back to back, after one untimed call; "step ms"
scales one layer's time to a step's 24 layers, beside the H100's FlashAttention-2 in `driver-compiled-opt`'s profile
(6.72 ms forward, 17.09 ms backward a step).

    python bench/attention_tiles.py --device cuda     # writes results/bench/attention_tiles_cuda.json

On the CPU, under Triton's interpreter (TRITON_INTERPRET=1) at a few short sequences, it checks the bench itself (the
candidates' results against the default's), not a speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model import time_steps  # noqa: E402  (bench/model.py, beside this file)

from bert.lengths import WIKI_PHASE2  # noqa: E402
from bert.model import triton_attention as ta  # noqa: E402

# (BM, BN, warps) to try for each kernel; the defaults first
FORWARD = [ta.FORWARD_TILE, (128, 128, 8), (64, 64, 4), (64, 128, 4), (128, 32, 4)]
DQ = [ta.BACKWARD_TILE, (128, 64, 8), (64, 128, 8), (32, 64, 4), (64, 32, 4)]
DKDV = [ta.BACKWARD_TILE, (128, 64, 8), (64, 128, 8), (32, 64, 4), (64, 32, 4)]
LAYERS = 24
FLASH2_H100_MS = {"forward": 6.72, "backward": 17.09}  # a step's, driver-compiled-opt's profile (2026-11-26)


def batch(sequences: int, heads: int, dim: int, longest: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q, k, v (views of one fused (T, 3, H, D) QKV, as in the model), dO, cu_seqlens, max_seqlen, the lengths."""
    lengths = np.minimum(WIKI_PHASE2.sample(sequences, np.random.default_rng(seed)), longest)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(int(lengths.sum()), 3, heads, dim, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(int(lengths.sum()), heads, dim, generator=g).to(device=device, dtype=dtype)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return (*qkv.unbind(1), grad, cu, int(lengths.max()), lengths)


def per_call(fn, device: str, repeats: int, calls: int) -> float:
    """Median seconds a call of `fn()`, each of `repeats` samples timing `calls` calls back to back (bench/model.py's
    timing, its warm-up call first): the launches of the next queue behind the kernels, so the host's share of a
    call hides behind the GPU's, as in a training step."""
    many = {"calls": lambda: [fn() for _ in range(calls)]}
    return statistics.median(time_steps(many, repeats, device, quiet=True)["calls"]) / calls


def largest_gap(got, want) -> float:
    """max |got - want| over the pairs of tensors, relative to each wanted tensor's largest magnitude; inf where a
    result is not finite (a NaN would otherwise drop out of the max)."""
    gaps = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got, want)]
    return max(gaps) if all(math.isfinite(g) for g in gaps) else math.inf


def one_line(e: Exception) -> str:
    """The exception's type and the first line of its message (a compiler's can run to pages)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def best(rows: list[dict], kernel: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """The tile of `kernel`'s fastest row whose results were right; `default` when none ran right."""
    timed = [r for r in rows if r["kernel"] == kernel and r.get("ok") and "layer_ms" in r]
    return tuple(min(timed, key=lambda r: r["layer_ms"])["tile"]) if timed else default


def sweep(args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    q, k, v, grad, cu, longest, lengths = batch(args.sequences, args.heads, args.dim, args.max_length, dtype, device)
    seed = torch.tensor(20261127, device=device)
    p, rows = args.dropout, []
    flops = 2 * 2 * args.heads * args.dim * float(np.square(lengths.astype(np.float64)).sum())  # the forward's products

    def forward(tile):
        return ta.launch_forward(q, k, v, cu, longest, p, seed, tile)

    base_out, base_lse, base_bits = forward(ta.FORWARD_TILE)

    def backward(q_tile, kv_tile):
        # (dq, dk, dv): the packed gradient's views
        return ta.launch_backward(grad, q, k, v, base_out, base_lse, base_bits, cu, longest, p, q_tile,
                                  kv_tile).unbind(1)

    base_grads = backward(ta.BACKWARD_TILE, ta.BACKWARD_TILE)

    def row(phase: str, kernel: str, tile, fn, check) -> dict:
        r = {"phase": phase, "kernel": kernel, "tile": list(tile) if tile else None}
        rows.append(r)
        try:
            got = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            r.update(check(got))
            seconds = per_call(fn, device, args.repeats, args.calls)
        except Exception as e:  # a tile that does not compile or run: its row says why, the rest go on
            r["error"] = one_line(e)
            print(f"{phase:8} {kernel:10} {tile}: {r['error']}", file=sys.stderr)
            return r
        r["layer_ms"] = round(seconds * 1e3, 4)
        r["step_ms"] = round(seconds * 1e3 * LAYERS, 3)
        r["tflops"] = round(flops * (2.5 if phase == "backward" else 1) / seconds / 1e12, 1)
        return r

    def forward_check(got):
        out, lse, bits = got
        same_bits = all(torch.equal(ta.unpack_bits(bits[:, a:b], b - a), ta.unpack_bits(base_bits[:, a:b], b - a))
                        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())) if p else True
        gap = largest_gap((out, lse), (base_out, base_lse))
        return {"same_mask": same_bits, "largest_gap": gap, "ok": same_bits and gap < args.tolerance}

    def backward_check(got):
        gap = largest_gap(got, base_grads)
        return {"largest_gap": gap, "ok": gap < args.tolerance}

    for tile in FORWARD:
        row("forward", "forward", tile, lambda t=tile: forward(t), forward_check)
    for tile in DQ:
        row("backward", "dq", tile, lambda t=tile: backward(t, ta.BACKWARD_TILE), backward_check)
    for tile in DKDV:
        row("backward", "dkdv", tile, lambda t=tile: backward(ta.BACKWARD_TILE, t), backward_check)

    pair = (best(rows, "dq", ta.BACKWARD_TILE), best(rows, "dkdv", ta.BACKWARD_TILE))
    row("backward", "dq+dkdv", None, lambda: backward(*pair), backward_check)["tiles"] = [list(t) for t in pair]
    if device == "cuda":  # FlashAttention-2 on the same tokens: what ATTENTION=varlen runs
        fa = {}
        row("forward", "flash2", None, lambda: fa.update(r=torch.ops.bert.flash_varlen(q, k, v, cu, longest, p)),
            lambda _: {})
        if "r" in fa:  # its backward replays the forward's dropout state
            out, lse, rng, unused = fa["r"]
            row("backward", "flash2", None, lambda: torch.ops.bert.flash_varlen_backward(
                grad, q, k, v, out, lse, rng, unused, cu, longest, p), lambda _: {})
    return {"rows": rows, "tokens": int(lengths.sum()), "best_forward": list(best(rows, "forward", ta.FORWARD_TILE)),
            "best_dq": list(pair[0]), "best_dkdv": list(pair[1])}


def table(result: dict) -> str:
    lines = [f"{'phase':8} {'kernel':8} {'BM x BN, warps':>15} {'layer ms':>9} {'step ms':>8} {'TFLOP/s':>8} "
             f"{'check':>12}"]
    for r in result["rows"]:
        tile = r.get("tiles") or ([r["tile"]] if r["tile"] else [])
        shape = " + ".join(f"{t[0]}x{t[1]},{t[2]}" for t in tile) or "-"
        if "error" in r:
            lines.append(f"{r['phase']:8} {r['kernel']:8} {shape:>15}  {r['error'][:70]}")
            continue
        check = "" if "ok" not in r else f"{'ok' if r['ok'] else 'WRONG'} {r['largest_gap']:.1e}"
        lines.append(f"{r['phase']:8} {r['kernel']:8} {shape:>15} {r['layer_ms']:9.3f} {r['step_ms']:8.2f} "
                     f"{r['tflops']:8.1f} {check:>12}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sequences", type=int, default=96)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512, help="the mix's lengths cut to this (the interpreter: short)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--calls", type=int, default=10, help="calls back to back in one timed sample")
    p.add_argument("--tolerance", type=float, default=2e-2, help="largest gap to the default tiles' results, relative")
    p.add_argument("--json", default=None, help="default: results/bench/attention_tiles_<device>.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if ta.triton is None:
        print("attention_tiles: needs Triton (torch's CUDA build)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attention_tiles: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("attention_tiles: --device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'cpu'} (interpreter)"
    out = Path(args.json or ROOT / "results" / "bench" / f"attention_tiles_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"device": name, "torch": torch.__version__, "triton": ta.triton.__version__, "args": vars(args)}
    try:
        result = sweep(args)
    except Exception as e:  # the default tiles' run, the reference of every row, failed: nothing to compare with
        error = one_line(e)
        out.write_text(json.dumps({**head, "error": error}, indent=1) + "\n")
        print(f"attention_tiles: the default tiles failed: {error}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"FlashAttention-2 in the H100's driver step: {FLASH2_H100_MS['forward']} ms forward, "
          f"{FLASH2_H100_MS['backward']} ms backward")
    out.write_text(json.dumps({**head, **result}, indent=1) + "\n")
    # a wrong result is a fault of the kernels (an error row, a tile this GPU cannot take, is not)
    return 1 if any(r.get("ok") is False for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
