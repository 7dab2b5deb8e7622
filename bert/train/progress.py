"""Progress on rank 0: one line per log interval on stdout and in <output_dir>/metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path


class Progress:
    def __init__(self, output_dir: str | Path, enabled: bool, resume: bool = False):
        self.enabled = enabled
        self._last_time, self._last_samples = time.perf_counter(), None
        if enabled:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(output_dir) / "metrics.jsonl", "a" if resume else "w")  # noqa: SIM115

    def log(self, **record) -> None:
        """One record of host values. A record with `loss` is a training interval and gets samples_per_s."""
        if not self.enabled:
            return
        if "loss" in record:
            now = time.perf_counter()
            if self._last_samples is not None:
                record["samples_per_s"] = round((record["samples"] - self._last_samples) / (now - self._last_time), 2)
            self._last_time, self._last_samples = now, record["samples"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        print(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
              flush=True)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
