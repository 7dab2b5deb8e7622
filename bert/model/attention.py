"""Variable-length multi-head attention over concatenated sequences, with backends chosen by name.

All backends take the packed QKV, (T, 3, heads, head_dim), for the tokens of a `SeqLayout` and return
(T, heads, head_dim) (`bert.model.attend`); a token attends to every token of its own sequence and to nothing else.
A backend is a planner: called once per batch with the `SeqLayout`, it does its host-side work
(index plans, grouping) and returns the `Attend` function every layer then calls.

    loop     one SDPA per sequence, on (1, H, L, D) inputs (4-D: the fused kernels, CPU flash included);
             exact and the fastest on CPU (`bench/model.py`, results/bench/model_cpu.json)
    grouped  Baidu's length-grouped attention ([001] §IV-A-2): one padded SDPA per length
             group (0,128], (128,256], (256,384], (384,512], q, k and v each scattered once into one
             buffer of the groups' blocks (`padding.GroupedLayout`); on CUDA each group on its own
             stream, eagerly (under torch.compile all on the current stream)
    varlen   CUDA flash attention on the unpadded tokens (`cuda_varlen.py`)
    cudnn    cuDNN's fused attention on the same ragged layout (`cudnn_varlen.py`; Hopper kernels, not measured yet)
    triton   our flash attention with dropout in Triton on the same tokens (`triton_attention.py`; Hopper's warpgroup
             MMA, 64-key tiles, not measured yet); on the CPU its torch path, the same mask
    padded   pad every sequence to the batch maximum, mask padded keys: the baseline
    auto     `varlen` when CUDA is available, else `loop`

`grouped` and `loop` change their kernels' shapes with every batch, so the config refuses them with CUDA graphs
(bert.config); `check_attention` refuses what cannot run on the device or in PRECISION's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bert.batch import SeqLayout
from bert.model.attend import Attend, unpacked
from bert.model.cuda_varlen import flash_varlen
from bert.model.cudnn_varlen import check_torch as check_cudnn_torch
from bert.model.cudnn_varlen import cudnn_varlen
from bert.model.padding import GroupedLayout, PadLayout, pad, pad_groups, unpad, unpad_groups
from bert.model.precision import compute_dtype
from bert.model.triton_attention import check_triton, triton_varlen

Planner = Callable[[SeqLayout], Attend]

GROUP_EDGES = (128, 256, 384)  # upper edges of all but the last group, as in Baidu [001] Figure 8


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, dropout_p: float) -> Tensor:
    """Attention on padded (B, L, H, D) tensors; key_mask (B, L) is True at real tokens."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask[:, None, None, :],
        dropout_p=dropout_p,
    )
    return out.transpose(1, 2)


def plan_loop(seq: SeqLayout) -> Attend:
    lengths = list(seq.lengths)

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        # split, not slicing: its backward is one cat, where each slice's backward would write a full-size
        # zero-filled (T, H, D) gradient per sequence. (L, H, D) -> (1, H, L, D): SDPA's fused kernels (CUDA's,
        # and the CPU's flash kernel) take 4-D inputs only, 3-D ones always run the math kernel
        parts = zip(*(t.split(lengths) for t in (q, k, v)))
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv), dropout_p=dropout_p)[0]
                .transpose(0, 1) for qkv in parts]
        return torch.cat(outs)

    return unpacked(attend)


def plan_padded(seq: SeqLayout) -> Attend:
    layout = PadLayout.build(seq)

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        out = masked_sdpa(pad(q, layout), pad(k, layout), pad(v, layout), layout.key_mask, dropout_p)
        return unpad(out, layout)

    return unpacked(attend)


def length_groups(lengths: Sequence[int], edges: Sequence[int] = GROUP_EDGES) -> list[list[int]]:
    """Indices of the sequences in each non-empty group (0, e0], (e0, e1], ..., (e_last, inf)."""
    group = np.searchsorted(np.asarray(edges), np.asarray(lengths), side="left")
    return [np.flatnonzero(group == g).tolist() for g in range(len(edges) + 1) if (group == g).any()]


@cache
def _side_streams(device: torch.device, n: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device) for _ in range(n))


def side_streams_wanted(device: torch.device) -> bool:
    """Whether `grouped` runs its groups on CUDA side streams: eagerly only, since dynamo (torch 2.11) does not
    trace stream switches and record_stream reliably; a compiled graph runs the groups on the current stream."""
    return device.type == "cuda" and not torch.compiler.is_compiling()


def plan_grouped(seq: SeqLayout) -> Attend:
    layout = GroupedLayout.build(seq, length_groups(seq.lengths))

    def attend(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        # q, k and v each scattered once into one buffer of blocks: one (T, H, D) gradient each in the backward
        groups = list(zip(*(pad_groups(t, layout) for t in (q, k, v)), layout.key_masks))  # (q, k, v, key_mask)
        run = lambda *group: masked_sdpa(*group, dropout_p)  # noqa: E731
        if side_streams_wanted(q.device):
            outs = _on_side_streams(groups, run, q.device)
        else:
            outs = [run(*group) for group in groups]
        return unpad_groups(outs, layout)

    return unpacked(attend)


def _on_side_streams(groups: Sequence[tuple[Tensor, ...]], run: Callable[..., Tensor], device: torch.device
                     ) -> list[Tensor]:
    """`run(*group)` for each group concurrently, one CUDA stream each, ordered against the main stream by events."""
    main = torch.cuda.current_stream(device)
    streams = _side_streams(device, len(GROUP_EDGES) + 1)[: len(groups)]
    outs = []
    for group, stream in zip(groups, streams):
        stream.wait_stream(main)  # an event: q, k, v are written on the main stream
        for t in group:
            # allocated on the main stream and read on this one, here and in the backward (which autograd runs on
            # the forward's stream): the allocator must not hand the memory on before this stream is done with it
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            outs.append(run(*group))
    for stream in streams:
        main.wait_stream(stream)  # an event: the next operator starts after every group is done
    for out in outs:
        out.record_stream(main)  # allocated on a side stream, consumed on the main one
    return outs


BACKENDS: dict[str, Planner] = {
    "loop": plan_loop,
    "grouped": plan_grouped,
    "varlen": flash_varlen,
    "cudnn": cudnn_varlen,
    "triton": triton_varlen,
    "padded": plan_padded,
}
ATTENTION_CHOICES = ("auto", *BACKENDS)  # what the config accepts: a backend, or `auto` to pick by device
CUDA_ONLY = ("varlen", "cudnn")  # fused kernels on the concatenated tokens


HALF_ONLY = CUDA_ONLY  # the same fused kernels take fp16/bf16 q, k, v only (cuda_varlen.require_half)
HALF_ON_CUDA = ("triton",)  # its kernels take fp16/bf16 (its torch path, the CPU's, any dtype)


def check_attention(name: str, device: torch.device, precision: str | None = None,
                    head_dim: int | None = None) -> None:
    """Raise a one-line ValueError naming ATTENTION when the backend cannot run on `device`, or, given PRECISION,
    in its compute dtype, or, given the model's head dimension, at that width (before any work, not at the first
    forward, which may be inside the timed run)."""
    if name in CUDA_ONLY and device.type != "cuda":
        raise ValueError(f"ATTENTION={name} needs a CUDA device (this run's is {device.type}): use ATTENTION=auto")
    if name == "cudnn":
        check_cudnn_torch()
    if name == "triton":
        check_triton(device, head_dim)
    backend = resolve_backend(name, device)
    half_only = backend in HALF_ONLY or (backend in HALF_ON_CUDA and device.type == "cuda")
    if precision is not None and half_only and compute_dtype(precision) == torch.float32:
        which = name if backend == name else f"{name} ({backend} on {device.type})"
        raise ValueError(f"ATTENTION={which} needs PRECISION=bf16, fp16 or fp8 (its kernels take half precision "
                         f"only), not PRECISION={precision}: set PRECISION=bf16, or ATTENTION=padded for fp32")


def resolve_backend(name: str, device: torch.device | str | None = None) -> str:
    """The concrete backend for `name`; `auto` looks at `device` (default: CUDA if available)."""
    if name == "auto":
        cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        return "varlen" if cuda else "loop"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    return name


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, seq: SeqLayout, dropout_p: float = 0.0,
                     backend: str = "auto") -> Tensor:
    """Attention of (T, H, D) tokens within their own sequences, q, k and v packed for the backend (a copy). Plans
    for one call; the model plans once per batch with `BACKENDS[name](seq)` and reuses the result in every layer."""
    return BACKENDS[resolve_backend(backend, q.device)](seq)(torch.stack((q, k, v), 1), dropout_p)
