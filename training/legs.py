"""A whole head-training run as legs of bounded length: `python -m training.legs`.

A machine lent for at most ten minutes a command cannot train for an hour in one
process. This driver splits the run of `python -m training.train` into legs, each one
process of at most --leg-seconds:

1. data: one leg generating OUT/data (skipped when --data is given or OUT/data exists);
2. training: legs that resume from OUT/train_state (head, optimizer, step, schedule and
   the position in the batch stream) and stop, checkpointed, before their time is up,
   until the planned steps are done (OUT/train_state/progress.json says so);
3. evaluation: a last leg that exports the head and measures it with the engine
   (OUT/report.json).

Every stage is skipped when its output is there, so the same command, run again after an
interruption or on a fresh lease with OUT kept, continues where the run stopped.
--max-legs ends this invocation after that many legs (exit status 3 while work is left),
for a caller whose own commands are bounded. Each leg's process is killed at its limit
plus a grace period; the checkpoint written every --save-every steps is then where the
next leg resumes.

    python -m training.legs --out runs/head --leg-seconds 540 -- \\
        --config configs/h200.yaml --arch eagle --samples 200000 --epochs 6 ...
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

# Exit status while legs are left (after --max-legs).
MORE_LEGS = 3
# The last training leg's time outside training (start-up, checkpoint, export), kept in OUT:
# a caller running one leg a command plans the next leg with it, not with the default guess.
STARTUP_FILE = "legs_startup.json"
# Where an unfinished leg exports the head as it stands (OUT/leg_head), and the file beside
# its weights that says where in the run it stands.
LEG_HEAD = "leg_head"
POSITION = "position.json"


def run_subprocess(argv: list[str], timeout: float) -> int:
    """One leg: `python -m training.train ARGV` in its own process, killed at `timeout`."""
    try:
        return subprocess.run([sys.executable, "-m", "training.train", *argv], timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"legs: leg killed after {timeout:.0f}s; the next one resumes from the last checkpoint",
              file=sys.stderr, flush=True)
        return 124


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def stage(out: Path, train_args: list[str]) -> str:
    """What the run needs next: "data", "train", "eval" or "done"."""
    if "--data" not in train_args and not (out / "data" / "train.jsonl").exists():
        return "data"
    if not _read(out / "train_state" / "progress.json").get("done"):
        return "train"
    report = _read(out / "report.json")
    if not report.get("train", {}).get("finished") or ("--no-eval" not in train_args and "acceptance" not in report):
        return "eval"
    return "done"


def run_legs(out: Path, train_args: list[str], leg_seconds: float, *, max_legs: int | None = None,
             startup_seconds: float = 90.0, grace_seconds: float = 30.0,
             run_leg: Callable[[list[str], float], int] = run_subprocess) -> int:
    """Run legs until the run is done (0), a leg fails (its status) or max_legs legs ran
    (MORE_LEGS). startup_seconds is kept free in each leg for loading the target and the
    data; after a training leg it is re-measured as the leg's time outside training, and
    kept in OUT/STARTUP_FILE for the next invocation, which starts from it."""
    base = ["--out", str(out), *train_args]
    startup_seconds = _read(out / STARTUP_FILE).get("seconds", startup_seconds)
    legs = 0
    t_run = time.monotonic()
    while True:
        what = stage(out, train_args)
        if what == "done":
            print(f"legs: done in {legs} legs this time ({time.monotonic() - t_run:.0f}s); "
                  f"report in {out / 'report.json'}", file=sys.stderr, flush=True)
            return 0
        if max_legs is not None and legs >= max_legs:
            print(f"legs: {legs} legs run, next stage: {what}; run the same command again",
                  file=sys.stderr, flush=True)
            return MORE_LEGS
        budget = max(leg_seconds - startup_seconds, 1.0)
        if what == "data":
            argv = base + ["--data-only", "--gen-time-budget", f"{budget:.0f}"]
        elif what == "train":
            argv = base + ["--resume", "--no-eval", "--leg-time-budget", f"{budget:.0f}"]
        else:  # the schedule is done: the resumed run only exports and measures
            argv = base + ["--resume"]
        # where the leg starts: the checkpoint's progress, else a carried leg head's position
        before = _read(out / "train_state" / "progress.json") or _read(out / LEG_HEAD / POSITION)
        legs += 1
        print(f"legs: leg {legs} ({what}), at most {leg_seconds:.0f}s", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        rc = run_leg(argv, leg_seconds + grace_seconds)
        wall = time.monotonic() - t0
        after = _read(out / "train_state" / "progress.json")
        if what == "train" and after:
            step0, step1, total = before.get("step", 0), after["step"], after["total_steps"]
            trained = _read(out / "leg_report.json").get("train", {}).get("seconds")
            if trained is not None and rc == 0:
                startup_seconds = max(startup_seconds * 0.5, wall - trained)
                (out / STARTUP_FILE).write_text(json.dumps({"seconds": round(startup_seconds, 1)}))
            rate = (step1 - step0) / wall if wall > 0 else 0.0
            left = (total - step1) / rate if rate > 0 else float("nan")
            print(f"legs: leg {legs}: steps {step0} -> {step1} of {total} ({100 * step1 / total:.1f}%), "
                  f"epoch {after['epoch']} batch {after['batch']}, loss {after.get('loss')}, "
                  f"{wall:.0f}s; about {left:.0f}s of training left", file=sys.stderr, flush=True)
            if rc not in (0, 124) or step1 <= step0:
                print(f"legs: leg {legs} made no progress (status {rc})", file=sys.stderr, flush=True)
                return rc or 1
        elif rc != 0:
            print(f"legs: {what} leg failed (status {rc})", file=sys.stderr, flush=True)
            return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m training.legs", description=__doc__.split("\n\n")[0],
                                epilog="Options after -- go to every leg of python -m training.train "
                                       "(not --out, --resume, --data-only or the budgets).")
    p.add_argument("--out", required=True)
    p.add_argument("--leg-seconds", type=float, default=540.0, help="one leg's wall time, at most")
    p.add_argument("--max-legs", type=int, default=None, help="end after this many legs (status 3 if not done)")
    p.add_argument("--startup-seconds", type=float, default=90.0,
                   help="time a leg spends outside training (target and data loading, export) "
                        f"until a leg has measured it (OUT/{STARTUP_FILE})")
    args = p.parse_args(own)
    for flag in ("--out", "--resume", "--data-only", "--leg-time-budget", "--train-time-budget",
                 "--gen-time-budget"):
        if flag in train_args:
            p.error(f"{flag} is the driver's; leave it out of the training options")
    return run_legs(Path(args.out), train_args, args.leg_seconds, max_legs=args.max_legs,
                    startup_seconds=args.startup_seconds)


if __name__ == "__main__":
    sys.exit(main())
