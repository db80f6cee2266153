"""The live frames fuzzer of tests/service/test_fuzz_frames.py, run long (R-DEC-3, R-BAD-3).

The same property as the CI test (150 derandomized examples there): a live ``Indexer``
over real ZMQ sockets indexes good vLLM batches, then takes hypothesis-generated
malformed messages (wrong frame counts, bad seq frames, garbage payloads at the expected
seq, old seqs with garbage), each example followed by one good batch; after every
example nothing indexed is lost, the index equals an offline reference fed the same
payloads, drops are counted exactly per worker and reason, and the bounds hold. Each
round is a fresh indexer and fresh publishers, seeded ``--seed``, ``--seed + 1``, ...:

    .venv/bin/python benchmarks/fuzz_frames.py                          # 10 rounds x 1000 examples (~15 min)
    .venv/bin/python benchmarks/fuzz_frames.py --rounds 1 --examples 300 --seed 42

Exits 1 on the first round that breaks the property, printing its seed and the
falsifying example (the messages sent, in order). The check after each example grows with
the prompts indexed so far, so very long rounds slow down: prefer more rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import test_fuzz_frames as ff  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="fresh indexers, one seed each (default 10)")
    ap.add_argument("--examples", type=int, default=1000, help="examples per round (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first round (default 0)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    for r in range(args.rounds):
        seed = args.seed + r
        t = time.monotonic()
        live = ff.Live()
        try:
            baseline = ff.seed_index(live)
            live.check(baseline)
            n = ff.fuzz(live, baseline, args.examples, derandomize=False, seed=seed)
            s = live.ix.stats()
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            traceback.print_exc()
            print(f"\nround {r}, seed {seed}: FAILED ({type(e).__name__}); rerun with --rounds 1 --seed {seed} "
                  f"--examples {args.examples}")
            return 1
        finally:
            try:
                live.close()
            except AssertionError as e:  # the ingest thread died
                print(f"round {r}, seed {seed}: {e}")
                return 1
        print(f"round {r}, seed {seed}: {n} examples in {time.monotonic() - t:.0f}s, e1 sent "
              f"{live.sent['e1']} messages; dropped {s['dropped_payloads']}; "
              f"decoder ignored {s['events'].get('unknown', {})}; nodes {s['nodes']}, tiers {len(s['tiers'])}",
              flush=True)
    print(f"{args.rounds} rounds, no failure, {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
