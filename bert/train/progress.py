"""Progress on rank 0: one line per log interval on stdout and in <output_dir>/metrics.jsonl.

A training record gets samples_per_s, tokens_per_s (rank 0's real tokens, padding left out) and, from the
matmul FLOPs of the batches trained in the interval (`bert.model.flops`, counted on the host from the batch
shapes by `FlopMeter`), tflops (achieved
TFLOP/s per GPU) and mfu (that over the GPU's peak, `bert.train.peak_flops`; left out where the peak is
unknown, e.g. on a CPU). Only rank 0 logs, so these are rank 0's batches: the loader gives every rank
the same number of sequences (and the balanced strategies about the same tokens), so rank 0's rate is
the per-GPU rate up to that balance, and the global rate is about world_size x tflops. The interval's
wall time includes any evaluation in it, as samples_per_s does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from bert.batch import Batch
from bert.model.config import BertConfig
from bert.model.flops import StepShape, train_flops
from bert.static_shapes import padding_sequences


class FlopMeter:
    """Training FLOPs and tokens of the batches drawn through `counting` since the last `take` (host
    arithmetic only).

    `static_tokens` (STATIC_TOKENS): the batches end in `bert.static_shapes`' padding sequences, which are left out;
    their padding masked rows cannot be told apart on the host (their labels are on the device) and are counted."""

    def __init__(self, cfg: BertConfig, static_tokens: int = 0, last_layer_subset: bool = True):
        self.cfg, self.subset, self.flops, self.tokens = cfg, last_layer_subset, 0, 0
        self.padding = padding_sequences(static_tokens) if static_tokens else 0

    def counting(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for batch in batches:
            lengths = batch.seq.lengths[:len(batch.seq.lengths) - self.padding]
            shape = StepShape.unpadded(lengths, batch.masked_labels.numel(), self.subset)
            self.flops += train_flops(self.cfg, shape)
            self.tokens += sum(lengths)
            yield batch

    def take(self) -> dict[str, int]:
        """The counts since the last call, as `Progress.log`'s train_flops and train_tokens; resets them."""
        taken = {"train_flops": self.flops, "train_tokens": self.tokens}
        self.flops = self.tokens = 0
        return taken


def flop_rates(flops: int, seconds: float, peak_flops: float | None) -> dict[str, float]:
    """tflops achieved per GPU and, when the peak FLOP/s is known, mfu (a fraction), to 4 significant digits."""
    achieved = flops / seconds
    rates = {"tflops": _sig4(achieved / 1e12)}
    if peak_flops:
        rates["mfu"] = _sig4(achieved / peak_flops)
    return rates


def _sig4(x: float) -> float:
    return float(f"{x:.4g}")


class Progress:
    def __init__(self, output_dir: str | Path, enabled: bool, resume: bool = False, peak_flops: float | None = None):
        """`peak_flops`: the GPU's peak FLOP/s for mfu (None: no mfu)."""
        self.enabled, self.peak_flops = enabled, peak_flops
        self._last_time, self._last_samples = time.perf_counter(), None
        if enabled:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            self._path = Path(output_dir) / "metrics.jsonl"
            self._file = open(self._path, "a" if resume else "w")  # noqa: SIM115

    def drop_after(self, step: int) -> None:
        """On resume from the checkpoint of `step`: forget the records of later steps, which a run killed past its
        last checkpoint had logged and the continuation logs again (a line cut short by the kill goes too)."""
        if not self.enabled:
            return
        self._file.close()
        kept = []
        for line in self._path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", 0) <= step:
                kept.append(line + "\n")
        self._path.write_text("".join(kept))
        self._file = open(self._path, "a")  # noqa: SIM115

    def log(self, **record) -> None:
        """One record of host values. A record with `loss` is a training interval and gets samples_per_s;
        given `train_tokens` and `train_flops` (this rank's tokens and FLOPs since the previous record; not
        logged themselves), also tokens_per_s, tflops and mfu. The first interval has no rates: its time
        includes start-up."""
        if not self.enabled:
            return
        flops, tokens = record.pop("train_flops", None), record.pop("train_tokens", None)
        if "loss" in record:
            now = time.perf_counter()
            if self._last_samples is not None:
                seconds = now - self._last_time
                record["samples_per_s"] = round((record["samples"] - self._last_samples) / seconds, 2)
                if tokens is not None:
                    record["tokens_per_s"] = round(tokens / seconds, 1)
                if flops is not None:
                    record.update(flop_rates(flops, seconds, self.peak_flops))
            self._last_time, self._last_samples = now, record["samples"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        print(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
              flush=True)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
