"""Read an MLPerf result log (`:::MLLOG {json}` lines) into events.

Shared by the tools in this folder. Like the official parser, text before `:::MLLOG` (a
`0: ` rank prefix from `srun -l`, a tee'd timestamp) is ignored, and so are lines without
the token. Unlike it, a malformed line is an error naming the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN = ":::MLLOG "


@dataclass(frozen=True)
class Event:
    key: str
    value: Any
    metadata: dict[str, Any]
    time_ms: float
    line: int  # 1-based line number in the file


class LogError(ValueError):
    pass


def read_events(path: str | Path) -> list[Event]:
    events = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            at = text.find(TOKEN)
            if at < 0:
                continue
            try:
                record = json.loads(text[at + len(TOKEN):])
                events.append(Event(record["key"], record["value"], record["metadata"] or {},
                                    record["time_ms"], number))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LogError(f"{path}:{number}: not an MLLOG record ({e})") from None
    return events


def values(events: list[Event], key: str) -> list[Any]:
    return [e.value for e in events if e.key == key]


def eval_schedule(global_batch_size: int) -> int:
    """Samples between evaluations by the training rules: FLOOR(0.05*(230.23*GBS+3e6), 25000)."""
    return math.floor(0.05 * (230.23 * global_batch_size + 3_000_000) / 25_000) * 25_000
