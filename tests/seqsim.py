"""An adversarial world for the sequencer: engines that restart, lose batches, reconnect,
overrun their replay buffer and answer replays late, twice or out of order.

Two halves that share no code with what they check:

* ``Model``: what an engine holds, as a few dicts (engine hash -> announcement count),
  fed the events of the engine's *current* incarnation only. It is the truth a router
  needs; it never touches ``PrefixIndex`` or the sequencer.
* ``World``: engines publishing real vLLM payloads (``encode_batch``, vLLM 0.33 layout)
  with a bounded replay ring as vLLM keeps it, and a transport that delivers, loses,
  reconnects and answers replays as the harness decides. The index side is the real
  :class:`indexer.sequence.sequencer.Stream` feeding a real :class:`indexer.PrefixIndex`.

A run ends with every worker either exactly equal to its ``Model`` or stale with a
reason (and, where the world made no proof impossible, not stale at all).
"""

from __future__ import annotations

import random
from collections import deque

from evkit import ehashes, toks
from indexer import PrefixIndex
from indexer.producer.events import Cleared, Removed, Stored, encode_batch
from indexer.sequence.sequencer import Stream

BS = 4


class Model:
    """The blocks one engine holds now (R-APP-4 counting), from its own event log."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def store(self, hashes) -> None:
        for h in hashes:
            self.count[h] = self.count.get(h, 0) + 1

    def remove(self, hashes) -> None:
        for h in hashes:
            n = self.count.get(h, 0)
            if n > 1:
                self.count[h] = n - 1
            elif n == 1:
                del self.count[h]

    def clear(self) -> None:
        self.count.clear()

    def prefix(self, hashes) -> int:
        """Leading blocks of a prompt this engine holds."""
        n = 0
        for h in hashes:
            if h not in self.count:
                break
            n += 1
        return n


def prompts(n: int) -> list[list[int]]:
    """Prompts of 2-6 blocks; every third one shares a 2-block prefix with another."""
    rng = random.Random(99)
    out = []
    for i in range(n):
        head = out[rng.randrange(len(out))][: 2 * BS] if out and i % 3 == 0 else []
        out.append(head + toks(10_000 * (i + 1), rng.randint(2, 6) - len(head) // BS, BS))
    return out


class Engine:
    """One vLLM engine rank as the wire shows it: seqs from 0 per incarnation, a replay
    ring of ``ring`` batches, ``time.time()``-like batch timestamps."""

    def __init__(self, name: str, ring: int, replay: bool, t0: float) -> None:
        self.name, self.ring, self.replay = name, ring, replay
        self.seq = 0
        self.buf: deque = deque(maxlen=ring)
        self.ts = t0
        self.model = Model()
        self.connected = True
        self.incarnations = 1

    def publish(self, events, hashes_of) -> tuple[int, bytes]:
        self.ts += 0.001
        payload = encode_batch(events, ts=self.ts, version="0.33")
        seq = self.seq
        self.seq += 1
        self.buf.append((seq, payload))
        for ev in events:
            if isinstance(ev, Stored):
                self.model.store(ev.block_hashes)
            elif isinstance(ev, Removed):
                self.model.remove(ev.block_hashes)
            else:
                self.model.clear()
        return seq, payload

    def restart(self, clock_behind: bool) -> None:
        self.seq = 0
        self.buf = deque(maxlen=self.ring)
        self.model = Model()
        self.ts += -60.0 if clock_behind else 1.0
        self.incarnations += 1

    def answer(self, start: int) -> list:
        """vLLM's replay answer: every buffered batch from ``start`` (silently from the
        oldest one it holds), then the end marker (None here)."""
        return [(s, p) for s, p in self.buf if s >= start] + [None]


class _Sink:
    def __init__(self, world: World, engine: Engine) -> None:
        self.world, self.engine = world, engine
        self.replay: list | None = None  # frames still to deliver, or None

    def apply_batch(self, stream, seq, payload):
        return self.world.index.apply_sequenced(self.engine.name, payload, seq=seq, dp_rank=0)

    def reset_worker(self, stream):
        self.world.index.reset_worker(self.engine.name, 0)

    def request_replay(self, stream, start):
        if not self.engine.replay:
            return f"batches from {start} lost and no replay endpoint"
        self.world.requests += 1
        frames = self.engine.answer(start)
        self.replay = self.world.mangle(frames)
        return None

    def cancel_replay(self, stream):
        self.replay = None

    def mark_stale(self, stream, reason):
        self.world.index.mark_stale(self.engine.name, 0, reason)

    def mark_fresh(self, stream):
        self.world.index.clear_stale(self.engine.name, 0)

    def count(self, stream, name):
        self.world.index.count(name)


class World:
    """Engines, a lossy transport and the index, stepped by one seeded RNG.

    ``faults`` picks what may go wrong: ``loss`` (live batches dropped), ``restart``
    (with the new incarnation's first batches lost), ``reconnect`` (a connection cut
    and restored, batches lost meanwhile), ``overrun`` (small replay rings),
    ``mangle`` (replay answers duplicated, reordered, cut short or never finished),
    ``noreplay`` (one engine without a replay endpoint), ``clock`` (restarts on a host
    whose clock is behind), ``slow`` (replays answered a few frames at a time, so live
    batches pile up and replays time out).
    """

    def __init__(self, seed: int, faults: set[str], *, engines: int = 3, nprompts: int = 24) -> None:
        self.rng = random.Random(seed)
        self.faults = faults
        self.now = 0.0
        self.requests = 0
        self.index = PrefixIndex()
        self.prompts = prompts(nprompts)
        self.hashes = [ehashes(p, BS) for p in self.prompts]
        self.engines: list[Engine] = []
        self.streams: list[Stream] = []
        self.sinks: list[_Sink] = []
        for i in range(engines):
            ring = self.rng.choice([3, 6, 50]) if "overrun" in faults else 10_000
            replay = not ("noreplay" in faults and i == 0)
            e = Engine(f"e{i}", ring, replay, 1_000.0 + i)
            sink = _Sink(self, e)
            self.engines.append(e)
            self.sinks.append(sink)
            self.streams.append(Stream(sink, max_buffered=64, replay_timeout_s=0.5, clock=lambda: self.now))
            self.index.register_worker(e.name, 0)

    # ----------------------------------------------------------- the world

    def mangle(self, frames: list) -> list:
        if "mangle" not in self.faults or self.rng.random() < 0.5:
            return list(frames)
        frames = list(frames)
        k = self.rng.randrange(4)
        if k == 0 and len(frames) > 1:  # a frame twice
            i = self.rng.randrange(len(frames) - 1)
            frames.insert(i, frames[i])
        elif k == 1 and len(frames) > 2:  # two frames swapped
            i = self.rng.randrange(len(frames) - 2)
            frames[i], frames[i + 1] = frames[i + 1], frames[i]
        elif k == 2:  # never ends: the replay must time out
            frames = frames[:-1]
        else:  # cut short: the end marker comes early
            frames = frames[: self.rng.randrange(len(frames))] + [None]
        return frames

    def event(self, e: Engine):
        r = self.rng.random()
        i = self.rng.randrange(len(self.prompts))
        hs = self.hashes[i]
        if r < 0.6:
            return [Stored(hs, None, self.prompts[i], BS, kv_cache_spec_kind="full_attention")]
        if r < 0.97:
            k = self.rng.randint(1, len(hs))
            return [Removed(hs[-k:][::-1])]
        return [Cleared()]

    def live(self, idx: int, events, *, lost: bool = False) -> None:
        e, st = self.engines[idx], self.streams[idx]
        seq, payload = e.publish(events, None)
        if e.connected and not lost:
            st.live(seq, payload)

    def step(self) -> None:
        rng = self.rng
        self.now += 0.01
        idx = rng.randrange(len(self.engines))
        e = self.engines[idx]
        r = rng.random()
        if "restart" in self.faults and r < 0.04:
            e.connected = False
            e.restart(clock_behind="clock" in self.faults and rng.random() < 0.3)
            for _ in range(rng.randint(0, 5)):  # PUB drops these: nobody is connected yet
                self.live(idx, self.event(e))
            self.reconnect(idx)
        elif "reconnect" in self.faults and r < 0.07:
            e.connected = False
            for _ in range(rng.randint(0, 4)):
                self.live(idx, self.event(e))
            self.reconnect(idx)
        else:
            self.live(idx, self.event(e), lost="loss" in self.faults and rng.random() < 0.08)
        for i, sink in enumerate(self.sinks):
            if sink.replay is not None and rng.random() < 0.5:
                self.deliver(i, rng.randint(1, 3) if "slow" in self.faults else 1_000)
            self.streams[i].check_timeout(self.now)

    def reconnect(self, idx: int) -> None:
        self.engines[idx].connected = True
        self.streams[idx].reconnected()

    def deliver(self, idx: int, n: int) -> None:
        sink, st = self.sinks[idx], self.streams[idx]
        for _ in range(n):
            frames = sink.replay
            if not frames:
                return
            f = frames.pop(0)
            if f is None:
                sink.replay = None
                st.replay_end()
                return
            st.replayed(*f)

    def settle(self) -> None:
        """No more faults: answer every replay in flight, let timeouts pass, then one
        more batch per engine (which may start and finish one more replay)."""
        self.faults = set()
        for _ in range(3):
            for i in range(len(self.engines)):
                while self.sinks[i].replay:  # an answer with no end marker waits for its timeout
                    self.deliver(i, 1)
            self.now += 10.0
            for st in self.streams:
                st.check_timeout(self.now)
        for i in range(len(self.engines)):
            self.live(i, [Stored(self.hashes[0][:1], None, self.prompts[0][:BS], BS,
                                 kv_cache_spec_kind="full_attention")])
            while self.sinks[i].replay:
                self.deliver(i, 1)

    # ------------------------------------------------------------ verdicts

    def verdicts(self) -> dict[str, tuple[bool, str | None, bool]]:
        """Per engine: (stale, reason, exact): exact = every prompt's GPU prefix and the
        resident count equal the model's."""
        out = {}
        workers = {w["engine"]: w for w in self.index.workers()}
        for e in self.engines:
            w = workers[e.name]
            exact = w["resident_blocks"].get("GPU", 0) == len(e.model.count)
            for p, hs in zip(self.prompts, self.hashes):
                got = self.index.match(p).worker(e.name, 0)
                n = 0 if got is None else got.tiers.get("GPU", 0)
                if n != e.model.prefix(hs):
                    exact = False
            out[e.name] = (w["stale"], w["stale_reason"], exact)
        return out
