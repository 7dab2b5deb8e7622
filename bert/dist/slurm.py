"""What Slurm's variables say about the job step (torch-free: the config's parse-time checks read it too).

SLURM_STEP_TASKS_PER_NODE is the step's own layout, one entry per node ('8(x2)', '4,3', '2(x3),1');
SLURM_NTASKS_PER_NODE is --ntasks-per-node, which a step may inherit from its allocation's sbatch and so may not
describe the step at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")  # the step's own first


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[03-05,7],cpu1' -> 'gpu03', 'rack[1-2]-n[01-04]' -> 'rack1-n01'."""
    head = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())  # up to the first comma outside brackets
    if not head:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], head.group(0))


def tasks_per_node(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """This node's task count in the step (its entry by SLURM_NODEID) and the variable it came from; None outside
    Slurm or when the value is malformed (the launcher scripts report those)."""
    node = environ.get("SLURM_NODEID", "0")
    node = int(node) if node.isdigit() else 0
    for name in VARIABLES:
        counts = _per_node(environ.get(name, ""))
        if counts:
            return counts[min(node, len(counts) - 1)], name
    return None


def _per_node(value: str) -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1]; [] if malformed or not positive."""
    counts: list[int] = []
    for entry in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", entry)
        if not match or int(match.group(1)) == 0:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
