"""The sequencer's long adversarial soak: many seeded worlds of engines that
restart (losing their new incarnation's first batches), reconnect, lose live batches,
overrun their replay ring, and answer replays late, twice, out of order, cut short or
never; restarts on hosts whose clock is behind.

Each world ends with every worker either exactly equal to an independent model of what
its engine holds (tests/seqsim.py: dicts, no PrefixIndex) or stale with a reason; in
honest worlds (replay endpoints that answer whole and in order) never stale. The short,
fixed-seed version runs in CI (tests/unit/test_sequencer.py); this one runs for minutes:

    .venv/bin/python benchmarks/soak_sequencer.py --worlds 400 --steps 3000

Exits 1 and prints the seed of any world that breaks the rule.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import seqsim  # noqa: E402

HONEST = {"loss", "restart", "reconnect", "clock"}
ADVERSARIAL = HONEST | {"overrun", "mangle", "noreplay", "slow"}


def run(seed: int, faults: set[str], steps: int) -> tuple[list[str], dict]:
    w = seqsim.World(seed, set(faults))
    for _ in range(steps):
        w.step()
    w.settle()
    bad = []
    honest = faults <= HONEST
    for name, (stale, reason, exact) in w.verdicts().items():
        if honest and (stale or not exact):
            bad.append(f"{name}: stale={stale} ({reason}) exact={exact}")
        elif not exact and not (stale and reason):
            bad.append(f"{name}: silently wrong")
    counters = w.index.stats()["counters"]
    counters["incarnations"] = sum(e.incarnations for e in w.engines)
    counters["stale_at_end"] = sum(1 for s, _, _ in w.verdicts().values() if s)
    return bad, counters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, default=200, help="worlds per kind (honest and adversarial)")
    ap.add_argument("--steps", type=int, default=3000, help="steps per world before it settles")
    ap.add_argument("--first-seed", type=int, default=10_000, help="seed of the first world")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    failures = 0
    for kind, faults in (("honest", HONEST), ("adversarial", ADVERSARIAL)):
        totals: dict[str, int] = {}
        for i in range(args.worlds):
            seed = args.first_seed + i
            bad, c = run(seed, faults, args.steps)
            for k, v in c.items():
                totals[k] = totals.get(k, 0) + v
            if bad:
                failures += 1
                print(f"{kind} world seed={seed} steps={args.steps}: " + "; ".join(bad))
        keys = ("incarnations", "restarts", "reconnects", "wire_gaps", "continuity_proven", "continuity_restart",
                "continuity_unproven", "replays_ok", "replays_failed", "batches_duplicate", "stale_at_end")
        print(f"{kind}: {args.worlds} worlds x {args.steps} steps: " + ", ".join(f"{k}={totals.get(k, 0)}" for k in keys))
    print(f"{'FAILED' if failures else 'ok'}: {failures} world(s) broke the rule; {time.monotonic() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
