"""The long run of the replay differential fuzzer (tests/replay/fuzz_grammar.py).

    python -m tests.replay.fuzz_long --steps 100000 --seed-start 1000 --out fuzz.json

runs cases of seeds 1000, 1001, ... (each one to three regions x --steps-per-region calls) until
--steps calls were compared with eager bit for bit (or --max-seconds passed), rewrites the JSON
after every case (so a run cut short still leaves its numbers), prints one line per case with
--verbose and a one-line summary at the end, and exits 1 when a call differed. One case alone
(what a mismatch report's "reproduce" line runs):

    python -m tests.replay.fuzz_long --seed-start 1234 --cases 1 --family plain --verbose

Several processes with disjoint seed ranges can run side by side (one per GPU with
CUDA_VISIBLE_DEVICES); add their "steps" and "mismatches".

Bucketing (``replay.padded`` arguments, ``capture(buckets=...)``) is the ``padded`` family. It
runs only when asked for, so the seeds of a run without --family keep drawing the three other
families as before; give it a process (and seed range) of its own:

    python -m tests.replay.fuzz_long --family padded --steps 100000 --seed-start 500000 --out fuzz-padded.json

The ``polymorphic`` family (bucketing with ``polymorphic=True``) runs only when asked for too:

    python -m tests.replay.fuzz_long --family polymorphic --steps 20000 --seed-start 900000 --out fuzz-poly.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from . import fuzz_grammar as fz


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.replay.fuzz_long", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="total calls to compare (default: no limit)")
    parser.add_argument("--seed-start", type=int, default=0, help="the first case seed")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    parser.add_argument("--steps-per-region", type=int, default=200, help="calls per region of a case")
    parser.add_argument(
        "--family",
        choices=fz.ALL_FAMILIES,
        default=None,
        help=(
            f"force one family (default: drawn per case from {', '.join(fz.FAMILIES)}; "
            f"{' and '.join(fz.BUCKETED_FAMILIES)} only when forced)"
        ),
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="start no case after this")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    parser.add_argument("--no-feedback", action="store_true", help="never pass an output back to its own graph")
    parser.add_argument("--stop-on-mismatch", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="one line per case, the full mismatch reports")
    parser.add_argument(
        "--harness-self-test",
        action="store_true",
        help="run on the CPU against an eager stand-in for the session (tests the runner, not replay)",
    )
    args = parser.parse_args(argv)
    if args.steps is None and args.cases is None and args.max_seconds is None:
        parser.error("give --steps, --cases or --max-seconds")
    if not torch.cuda.is_available() and not args.harness_self_test:
        print("fuzz_long: no CUDA GPU here", file=sys.stderr)
        return 2

    def write(summary: fz.RunSummary) -> None:
        if args.out is None:
            return
        data = {
            "command": "python -m tests.replay.fuzz_long " + " ".join(argv if argv is not None else sys.argv[1:]),
            **summary.as_dict(),
            "steps_per_region": args.steps_per_region,
            "family": args.family or "drawn per case",
            "feedback": not args.no_feedback,
            "device": "cpu (harness self-test)" if args.harness_self_test else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "finished": False,
        }
        data.update(extra)
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as handle:
            json.dump(data, handle, indent=2, default=str)
        os.replace(tmp, args.out)

    extra: dict = {}
    harness = fz.Harness(feedback=not args.no_feedback, log=print if args.verbose else None)
    if args.harness_self_test:
        harness = fz.Harness(
            device="cpu",
            session_factory=fz.EagerSession,
            launchers=fz.REFERENCE_LAUNCHERS,
            feedback=not args.no_feedback,
            log=print if args.verbose else None,
        )
    summary = fz.run(
        harness,
        seed_start=args.seed_start,
        steps=args.steps,
        cases=args.cases,
        steps_per_region=args.steps_per_region,
        family=args.family,
        stop_on_mismatch=args.stop_on_mismatch,
        max_seconds=args.max_seconds,
        on_case=write,
    )
    extra["finished"] = True
    write(summary)
    if summary.mismatches:
        for mismatch in summary.mismatches if args.verbose else summary.mismatches[:1]:
            print(mismatch.report(), file=sys.stderr)
    if summary.fallbacks and args.verbose:
        for reason, count in summary.fallbacks.most_common():
            print(f"  fallback x{count}: {reason}")
    print(summary.line())
    return 1 if summary.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
