"""Check MLPerf BERT result logs for what the official checkers let through.

The compliance checker passes a log if *any* eval reached 0.720 and never reads the run_stop
status, the eval cadence or what `epoch_num` counts; the RCP checker trusts `status`. This
tool checks, per log (reference: training rules, "Deprecated benchmarks" / BERT):

* the log is not a continuation (`resumed_from_checkpoint`): a run result times one contiguous run;
* exactly one `run_start` and one `run_stop` (one logging rank), run_stop carries a status;
* init (first `init_start` to `init_stop`) under the division's limit: 30 min closed, 240 open;
* convergence: last `eval_accuracy` before `run_stop` >= target  <=>  status is "success";
* every eval's `epoch_num` is an integer sample count: positive, increasing, a whole number of
  global batches (an epoch index like 1 would look like converging absurdly fast);
* `train_samples` equals the last eval's `epoch_num`; `eval_samples` equals the eval-set size;
* evals happen where the cadence puts them: the k-th at ceil((start + k*every) / GBS) * GBS,
  with start/every from the command line, else the logged `eval_iter_start_samples` /
  `eval_iter_samples`, else the rules' formula for both.

    python logging/verify_result.py results/CPU_1x2/bert/result_0.txt [...] [--target 0.72]

Prints one line per violation and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from result_log import Event, LogError, eval_schedule, read_events, values

INIT_LIMIT_MIN = {"closed": 30, "open": 240}
RESUMED = "resumed_from_checkpoint"  # bert.train.mlperf_log.RESUMED


@dataclass(frozen=True)
class Expect:
    target: float = 0.720
    eval_samples: int = 10_000
    eval_start: int | None = None
    eval_every: int | None = None


def _one(events: list[Event], key: str, problems: list[str]) -> Event | None:
    found = [e for e in events if e.key == key]
    if len(found) != 1:
        problems.append(f"{key}: expected exactly one, found {len(found)}")
        return None
    return found[0]


def _evals_before_stop(events: list[Event], run_stop: Event | None) -> list[Event]:
    last_line = run_stop.line if run_stop else math.inf
    return [e for e in events if e.key == "eval_accuracy" and e.line < last_line]


def check_run_bounds(events: list[Event]) -> list[str]:
    problems: list[str] = []
    _one(events, "run_start", problems)
    stop = _one(events, "run_stop", problems)
    if stop and stop.metadata.get("status") not in ("success", "aborted"):
        problems.append(f"run_stop: status {stop.metadata.get('status')!r} is not 'success' or 'aborted'")
    return problems


def check_init_time(events: list[Event]) -> list[str]:
    starts = [e.time_ms for e in events if e.key == "init_start"]
    stops = [e.time_ms for e in events if e.key == "init_stop"]
    if not starts or not stops:
        return ["init_start/init_stop: missing"]
    division = (values(events, "submission_division") or ["closed"])[0]
    limit = INIT_LIMIT_MIN.get(division, INIT_LIMIT_MIN["closed"])
    minutes = (stops[0] - starts[0]) / 60_000
    return [f"init: took {minutes:.1f} min, limit is {limit} min ({division})"] if minutes >= limit else []


def check_convergence(events: list[Event], target: float) -> list[str]:
    stop = next((e for e in events if e.key == "run_stop"), None)
    evals = _evals_before_stop(events, stop)
    if not evals:
        return ["eval_accuracy: none before run_stop"]
    last = evals[-1].value
    status = stop.metadata.get("status") if stop else None
    reached = isinstance(last, (int, float)) and target <= last < 1.0
    if reached != (status == "success"):
        return [f"convergence: last eval_accuracy {last} vs target {target} but run_stop status is {status!r}"]
    return []


def check_epoch_nums(events: list[Event], gbs: int | None) -> list[str]:
    problems, previous = [], 0
    for e in (e for e in events if e.key == "eval_accuracy"):
        n = e.metadata.get("epoch_num")
        if not isinstance(n, int) or isinstance(n, bool) or n <= previous:
            problems.append(f"eval_accuracy line {e.line}: epoch_num {n!r} is not an increasing integer sample count")
        elif gbs and n % gbs:
            problems.append(f"eval_accuracy line {e.line}: epoch_num {n} is not a whole number of "
                            f"global batches ({gbs}): an epoch index or a wrong unit")
        previous = n if isinstance(n, int) else previous
    return problems


def check_sample_counts(events: list[Event], eval_samples: int) -> list[str]:
    problems: list[str] = []
    stop = next((e for e in events if e.key == "run_stop"), None)
    evals = _evals_before_stop(events, stop)
    train = _one(events, "train_samples", problems)
    if train and evals and train.value != evals[-1].metadata.get("epoch_num"):
        problems.append(f"train_samples: {train.value} != last eval's epoch_num {evals[-1].metadata.get('epoch_num')}")
    logged_eval = _one(events, "eval_samples", problems)
    if logged_eval and logged_eval.value != eval_samples:
        problems.append(f"eval_samples: {logged_eval.value} != eval-set size {eval_samples}")
    return problems


def check_cadence(events: list[Event], gbs: int | None, start: int | None, every: int | None) -> list[str]:
    if not gbs:
        return ["global_batch_size: not logged, cannot check the eval cadence"]
    start = start or (values(events, "eval_iter_start_samples") or [None])[0] or eval_schedule(gbs)
    every = every or (values(events, "eval_iter_samples") or [None])[0] or eval_schedule(gbs)
    got = [e.metadata.get("epoch_num") for e in events if e.key == "eval_accuracy"]
    want = [math.ceil((start + k * every) / gbs) * gbs for k in range(len(got))]
    if got != want:
        return [f"eval cadence: evals at {got}, expected {want} (first at {start}, every {every} samples, GBS {gbs})"]
    return []


def check_not_resumed(events: list[Event]) -> list[str]:
    """The driver labels a run continued from a checkpoint; its log times only the continuation."""
    resumed = next((e for e in events if e.key == RESUMED), None)
    if resumed is None:
        return []
    return [f"not a result: resumed from a checkpoint at step {resumed.value} ({resumed.metadata.get('samples')} "
            "samples); a run result is one contiguous timed run"]


def verify(path: str | Path, expect: Expect) -> list[str]:
    events = read_events(path)
    if check_not_resumed(events):  # the other checks would only add noise about the missing first part
        return check_not_resumed(events)
    gbs = (values(events, "global_batch_size") or [None])[0]
    return (check_run_bounds(events) + check_init_time(events) + check_convergence(events, expect.target)
            + check_epoch_nums(events, gbs) + check_sample_counts(events, expect.eval_samples)
            + check_cadence(events, gbs, expect.eval_start, expect.eval_every))


def problems_of(path: str | Path, expect: Expect) -> list[str]:
    """`verify`'s problems, or the one that kept the log from being read."""
    try:
        return verify(path, expect)
    except (OSError, LogError) as e:
        return [str(e)]


def _count(text: str) -> int:
    """A sample count as the shell configs write it: 150000 or 1.5e5."""
    value = float(text)
    if value != int(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole sample count")
    return int(value)


def add_expect_args(p: argparse.ArgumentParser) -> None:
    """What the logs are checked against (here and in make_submission.py): `expect_from` reads them back."""
    p.add_argument("--target", type=float, default=Expect.target, help="MLM accuracy target (default 0.720)")
    p.add_argument("--eval-samples", type=_count, default=Expect.eval_samples, help="eval-set size (default 10000)")
    p.add_argument("--eval-start", type=_count, help="samples at the first eval (default: logged, else the formula)")
    p.add_argument("--eval-every", type=_count, help="samples between evals (default: logged, else the formula)")


def expect_from(args: argparse.Namespace) -> Expect:
    return Expect(args.target, args.eval_samples, args.eval_start, args.eval_every)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    add_expect_args(p)
    args = p.parse_args(argv)
    expect = expect_from(args)
    failed = 0
    for log in args.logs:
        problems = problems_of(log, expect)
        for problem in problems:
            print(f"FAIL {log}: {problem}")
        if not problems:
            print(f"PASS {log}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
