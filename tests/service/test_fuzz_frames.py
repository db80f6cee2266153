"""Malformed live messages, fuzzed, against a live subscriber (contract R-DEC-3, R-BAD-3).

A real :class:`indexer.ingest.live.Indexer` subscribes over real ZMQ sockets on 127.0.0.1 to
two :class:`~indexer.producer.publisher.VllmPublisher` engines (vLLM's wire protocol,
payloads encoded as vLLM encodes them). It first indexes good batches and the test
records every answer; then hypothesis (derandomized: the same examples on every run,
no shrinking: the index carries state from one example to the next) throws malformed
messages at engine ``e1``, each example followed by one good batch at the next seq:

* wrong frame counts (1, 2, 4+ frames, some carrying a valid seq and payload);
* seq frames that are not 8 bytes;
* at the seq the stream expects, payloads that are garbage: random bytes, truncated
  vLLM payloads, valid msgpack of the wrong shape, batches whose events have wrong
  tags or wrong field types (strings for hashes and token ids, ints past 2**32 and
  2**63, negative block sizes, NaN and inf, '³' '١' and control characters, bytes,
  ext types, nested arrays and maps), length headers claiming 4 GiB, stores that
  reuse blocks already indexed but carry bad token ids (all or nothing);
* first in an example, an already used seq with a garbage payload whose ts is not newer
  (R-STR-1 duplicate, R-STR-7: the sequencer proves continuity with a replay first).

After every example: every answer recorded before is unchanged, the good batch is
indexed, the index equals a reference ``PrefixIndex`` fed the same payloads in seq order
(so what the garbage did do, it did exactly as the decoder and the applier say), the
drops are counted per worker and reason, exactly (R-DEC-3), the ingest thread runs,
nothing is buffered, and every bounded thing stays in its bound (R-BAD-3).

What the fuzzer deliberately does not send (the contract makes them change answers,
legitimately): ``AllBlocksCleared``, removals of blocks already indexed, stores in a
KV-cache group other than 0 (R-APP-10: a new default group changes every headline),
and seqs ahead of the stream (a gap: repaired or stale, see
``test_R_STR_2_R_STR_5_R_BAD_3_forged_future_seq_costs_a_rebuild_never_an_entry``).
The bugs the fuzzing found are pinned at the end, each by the test that found it.

``benchmarks/fuzz_frames.py`` runs the same property with many more examples.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from evkit import chunks, ehashes, removed, store, toks, total
from indexer import PrefixIndex
from indexer.ingest.live import Indexer
from indexer.producer.events import Stored, encode_batch
from indexer.producer.publisher import VllmPublisher
from indexer.wire.events import BLOCK_REMOVED, BLOCK_STORED, MAP_LAYOUT_SINCE
from svc import wait_until

LOCAL = "tcp://127.0.0.1:*"
BS = 4
BASE_TS = 1_767_225_600.0  # good batches: BASE_TS + n, strictly increasing
BASE_TOK = 5_000_000  # token ids of the indexed prompts: far from what the fuzzer favours
MAX_ORPHANS = 4
INDEX_OPTS: dict[str, Any] = {"max_orphans": MAX_ORPHANS, "orphan_ttl_s": 3600.0}
MAX_DEPTH = 200  # nesting the fuzzer builds (5,000 deep: the nested-payload test below)
EXAMPLES = 150  # CI; benchmarks/fuzz_frames.py runs thousands
WAIT = 30.0  # bound of every poll (a loaded machine); never an asserted timing


def prompt(i: int) -> list[int]:
    return toks(BASE_TOK + 1000 * i, 4, BS)


def seq8(s: int) -> bytes:
    return s.to_bytes(8, "big")


SEEDED = (0, 1, 2)  # prompts indexed on e1 before the fuzzing (2 also in the CPU tier)
KNOWN = sorted({h for i in SEEDED for h in ehashes(prompt(i), BS)})  # their engine hashes
BYSTANDER = 3  # e2's prompt (and e2 holds prompt 0 too)
STORED_FIELDS = [f.name for f in BLOCK_STORED.fields]
REMOVED_FIELDS = [f.name for f in BLOCK_REMOVED.fields]
ARRAY_FIELDS = {
    "BlockStored": [f.name for f in BLOCK_STORED.fields if f.since < MAP_LAYOUT_SINCE],
    "BlockRemoved": [f.name for f in BLOCK_REMOVED.fields if f.since < MAP_LAYOUT_SINCE],
}
# Labels are bounded: fixed names, never a piece of what a publisher sent.
LABEL = re.compile(r"[a-z][a-z0-9_]*")
ISSUES = {"unknown_event_type", "unknown_field", "malformed_event"}


# ----------------------------------------------------------------- strategies

TEXT = st.one_of(
    st.sampled_from(["", "GPU", "gpu", "CPU", "STORAGE", "REMOTE", "³", "١", "²³", "٣", "\x00", "\n", "\x00GPU",
                     "GPU\n", "\u202e", "😀", "NaN", "-1", "18446744073709551616", "BlockStored"]),
    st.text(st.sampled_from("aZ09³١٣\x00\n\t \u202e😀"), max_size=10),
)
INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
FLOATS = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 2.0**64]))
# Valid msgpack a vLLM decoder never expects: ext types (-1 is msgpack's timestamp).
EXT = st.sampled_from([b"\xd4\x7f\x00", b"\xc7\x01\x05\x00", b"\xd6\xff\x00\x00\x00\x00",
                       b"\xd7\xff" + b"\xff" * 8, b"\xc7\x00\x01"]).map(msgspec.Raw)
DEEP = st.integers(1, MAX_DEPTH).map(lambda d: msgspec.Raw(b"\x91" * d + b"\xc0"))
SCALAR = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT, st.binary(max_size=16), EXT, DEEP)
ANY = st.recursive(
    SCALAR,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT | st.integers(-3, 3), c, max_size=4),
    max_leaves=12,
)
HASH = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))  # R-DEC-2 types, unknown values
# A token id that cannot be one: out of uint32, the wrong type, a digit that is not ASCII.
BAD_TOKEN = st.sampled_from([-1, 2**32, 2**64 - 1, -(2**63), "³", "١", "1", "\x00", "", 1.5, math.nan,
                             math.inf, None, True, [1], {"a": 1}, b"\x01"])
GROUP = st.sampled_from([None, 0, -1, 64, 2**63, 2**64 - 1])  # group 0, or out of range
RANK = st.one_of(st.sampled_from([None, 0, 1, 2, -1, 1024, 2**63, 2**64 - 1]), TEXT, FLOATS)
# A header claiming far more than follows (array, map, str, bin, ext of 4 GiB...).
BOMB = st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                        b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xdc\xff\xff", b"\xd9\xff", b"\xc1"])


def _sane_group(ev: dict) -> dict:
    g = ev.get("group_idx")
    if type(g) is int and 0 < g < 64:  # noqa: E721 - bool is not a group
        ev["group_idx"] = 0  # R-APP-10: another group changes every headline, legitimately
    return ev


@st.composite
def random_store(draw) -> dict:
    """A BlockStored of blocks nobody indexed: a whole shape, or a random one."""
    hashes = draw(st.lists(HASH, min_size=0, max_size=4))
    bs = draw(st.sampled_from([BS, BS, BS, BS, 0, -1, 8, 2**63 - 1, -(2**63)]))
    if draw(st.sampled_from([True, True, True, False])) and 0 < bs <= 16:
        tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes) * bs, max_size=len(hashes) * bs))
    else:
        tokens = draw(st.lists(st.integers(0, 2**32 - 1), max_size=12))
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes,
                          "parent_block_hash": draw(st.none() | HASH), "token_ids": tokens, "block_size": bs}
    opt = {"medium": st.none() | TEXT, "lora_id": st.none() | INTS, "lora_name": st.none() | TEXT,
           "extra_keys": st.none() | st.lists(ANY, max_size=4), "group_idx": GROUP,
           "kv_cache_spec_kind": st.none() | TEXT, "kv_cache_spec_sliding_window": st.none() | INTS,
           "locality": st.none() | TEXT, "ownership": st.none() | TEXT, "session_id": st.none() | TEXT,
           "lookahead_token_ids": st.none() | st.lists(st.lists(INTS, max_size=3), max_size=2)}
    for k in draw(st.lists(st.sampled_from(sorted(opt)), max_size=4, unique=True)):
        ev[k] = draw(opt[k])
    return ev


@st.composite
def random_removed(draw) -> dict:
    """A BlockRemoved of blocks nobody indexed."""
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": draw(st.lists(HASH, max_size=4))}
    for k, s in (("medium", st.none() | TEXT), ("group_idx", GROUP), ("locality", st.none() | TEXT),
                 ("ownership", st.none() | TEXT)):
        if draw(st.booleans()):
            ev[k] = draw(s)
    return ev


@st.composite
def mistyped(draw) -> dict:
    """A store or removal with 1-3 fields (or unknown ones) of any type at all."""
    ev = draw(random_store() | random_removed())
    names = STORED_FIELDS if ev["type"] == "BlockStored" else REMOVED_FIELDS
    for k in draw(st.lists(st.sampled_from(names + ["zz_unknown", "\x00", "³"]), min_size=1, max_size=3)):
        ev[k] = draw(ANY)
    return _sane_group(ev)


@st.composite
def known_bad_tokens(draw) -> dict:
    """A GPU store that reuses blocks already indexed, then new ones, with one bad token id:
    rejected as a whole (its known blocks take back the reference they took)."""
    known = draw(st.lists(st.sampled_from(KNOWN), min_size=1, max_size=3, unique=True))
    new = draw(st.lists(st.integers(0, 2**64 - 1).filter(lambda h: h not in KNOWN), min_size=1, max_size=2))
    hashes = draw(st.permutations(known + new)) if draw(st.booleans()) else known + new
    tokens: list[Any] = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes) * BS,
                                      max_size=len(hashes) * BS))
    for i in draw(st.lists(st.integers(0, len(tokens) - 1), min_size=1, max_size=3)):
        tokens[i] = draw(BAD_TOKEN)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": draw(st.none() | st.sampled_from(KNOWN)),
            "token_ids": tokens, "block_size": BS, "medium": draw(st.sampled_from([None, "GPU", "gpu"]))}


@st.composite
def wrong_tag(draw) -> Any:
    tag = draw(st.one_of(st.sampled_from(["", "blockstored", "BlockStored ", "BlockStored\x00", "Block\nStored",
                                          "BlockRemoved³", "١", "AllBlocksCleared ", "KVCacheEvent", "BlockStoredV2"]),
                         INTS, FLOATS, st.none(), st.binary(max_size=8), st.lists(TEXT, max_size=2)))
    if draw(st.booleans()):
        ev = draw(st.dictionaries(st.sampled_from(STORED_FIELDS), ANY, max_size=4))
        ev["type"] = tag
        return ev
    return [tag, *draw(st.lists(ANY, max_size=6))]


def positional(ev: Any) -> Any:
    """The vLLM <= 0.23 layout of a map event: [tag, fields in wire order...]."""
    if not isinstance(ev, dict) or not isinstance(ev.get("type"), str) or ev["type"] not in ARRAY_FIELDS:
        return ev
    return [ev["type"], *(ev.get(f) for f in ARRAY_FIELDS[ev["type"]])]


EVENT = st.one_of(random_store().map(_sane_group), random_removed().map(_sane_group), mistyped(),
                  known_bad_tokens(), wrong_tag(), ANY)
TS = st.one_of(FLOATS, INTS, TEXT, st.none(), st.lists(FLOATS, max_size=2))


@st.composite
def batch(draw, envelope_ok: bool) -> bytes:
    """The batch envelope [ts, events, data_parallel_rank] around bad events: a valid one
    (the events reach the decoder's slow path and the applier), or a broken one."""
    events = draw(st.lists(EVENT, min_size=1, max_size=5))
    if draw(st.booleans()):
        events = [positional(e) for e in events]
    if envelope_ok:
        ts = draw(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**63), 2**64 - 1))
        env = [ts, events, draw(st.sampled_from([None, 0, 0, 0]))]
        return msgspec.msgpack.encode(env[:2] if draw(st.booleans()) and env[2] is None else env)
    env = [draw(TS), draw(st.just(events) | ANY), draw(RANK)]
    shape = draw(st.sampled_from([3, 3, 2, 4, 1]))
    env = env[:shape] if shape < 3 else env + [draw(ANY)] if shape == 4 else env
    return msgspec.msgpack.encode(env)


@st.composite
def truncated(draw) -> bytes:
    """A vLLM payload (the publisher's encoder) cut short."""
    n = draw(st.integers(1, 3))
    ev = Stored(block_hashes=draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
                parent_block_hash=None, token_ids=list(range(n * BS)), block_size=BS)
    p = encode_batch([ev], ts=BASE_TS, version=draw(st.sampled_from(["0.23", "0.24", "0.33"])))
    return p[: draw(st.integers(1, len(p) - 1))]


@st.composite
def bomb(draw) -> bytes:
    head = draw(st.sampled_from([b"", b"\x93\xcb" + msgspec.msgpack.encode(BASE_TS)[1:], b"\x93\xcb"
                                 + msgspec.msgpack.encode(BASE_TS)[1:] + b"\x91"]))
    return head + draw(BOMB) + draw(st.binary(max_size=8))


PAYLOAD = st.one_of(
    batch(True), batch(True), batch(True), batch(False), truncated(), bomb(),
    st.binary(max_size=64),
    ANY.map(msgspec.msgpack.encode),
    DEEP.map(lambda r: bytes(r)),
)
FRAME = st.one_of(st.binary(max_size=24), st.sampled_from([b"", seq8(0), b"\xff" * 8]), PAYLOAD)
BAD_COUNT = st.sampled_from([1, 2, 4, 5, 8]).flatmap(lambda n: st.lists(FRAME, min_size=n, max_size=n))
BAD_SEQ = st.tuples(FRAME, st.binary(max_size=16).filter(lambda b: len(b) != 8), FRAME).map(list)
_elems = msgspec.msgpack.Decoder(list[msgspec.Raw])


def ts_not_newer(p: bytes) -> bool:
    """True when ``p`` cannot be read as a batch whose ts is newer than every good batch
    (R-STR-5 would take it for a restart, rightly). Conservative: an array whose element 0
    is any number above BASE_TS is out."""
    try:
        first = msgspec.msgpack.decode(_elems.decode(p)[0])
    except Exception:
        return True
    return not isinstance(first, (int, float)) or math.isnan(first) or first < BASE_TS


MESSAGE = st.one_of(
    st.tuples(st.just("frames"), BAD_COUNT),
    st.tuples(st.just("frames"), BAD_SEQ),
    st.tuples(st.just("next"), PAYLOAD),
    st.tuples(st.just("next"), PAYLOAD),
)
OLD = st.tuples(st.just("old"), st.tuples(st.integers(0, 2**31), PAYLOAD.filter(ts_not_newer)))


def frame_reason(frames: list[bytes]) -> str:
    return "bad_frame_count" if len(frames) != 3 else "bad_seq_frame"


# ------------------------------------------------------------------- the rig


def strip(answer: dict, keep_seq: bool = False) -> dict:
    for w in answer["workers"]:
        w.pop("last_event_age_s", None)
        if not keep_seq:
            w.pop("last_seq", None)
    return answer


class Live:
    """Two publishers (e1 fuzzed, e2 a bystander), a live Indexer, and a reference index
    fed every payload the publishers numbered, in seq order."""

    def __init__(self) -> None:
        self.pubs = [VllmPublisher(LOCAL, LOCAL, version="0.33"), VllmPublisher(LOCAL, LOCAL, version="0.23")]
        self.ix = Indexer([{"id": e, "endpoint": p.live_endpoint, "replay_endpoint": p.bound_replay_endpoint}
                           for e, p in zip(("e1", "e2"), self.pubs)],
                          replay_timeout_s=WAIT, reconnect_ivl_max_ms=500, **INDEX_OPTS)
        self.ref = PrefixIndex(**INDEX_OPTS)
        self.sent = {"e1": 0, "e2": 0}  # live messages sent
        self.frame_drops: Counter[str] = Counter()  # e1's drops before decoding, expected
        self.recorded: dict[int, dict] = {}  # prompt -> its answer when indexed
        self.good = 0  # good batches published (their ts and prompt numbers)
        self.ix.start()

    def pub(self, e: str) -> VllmPublisher:
        return self.pubs[0 if e == "e1" else 1]

    def w(self, e: str, rank: int = 0) -> dict:
        for w in self.ix.workers():
            if w["engine"] == e and w["dp_rank"] == rank:
                return w
        raise AssertionError(f"no worker {e}/{rank}")

    def close(self) -> None:
        err = self.ix.error
        self.ix.stop()
        for p in self.pubs:
            p.close()
        assert err is None, err

    # ------------------------------------------------------------- sending

    def raw(self, e: str, frames: list[bytes]) -> None:
        self.pub(e).send_raw(frames)
        self.sent[e] += 1

    def publish(self, e: str, payload: bytes) -> int:
        seq = self.pub(e).publish_payload(payload)
        self.sent[e] += 1
        self.ref.apply(e, payload, dp_rank=0, seq=seq)
        return seq

    def good_batch(self, e: str, events) -> int:
        self.good += 1
        pub = self.pub(e)
        return self.publish(e, encode_batch(events, ts=BASE_TS + self.good, dp_rank=0, version=pub.version))

    def subscribe(self) -> None:
        """Probe until each SUB receives (PUB drops what it sends before the subscription
        reaches it); the probes are 1-frame messages, counted as drops like any other."""
        for e in ("e1", "e2"):
            def got(e=e):
                self.pub(e).send_raw([b"probe"])
                return self.w(e).get("messages")
            wait_until(got, WAIT, 0.02, msg=f"{e} receives")

    def settle(self, e: str, seq: int) -> None:
        """Wait until every live message sent to ``e`` was received and ``seq`` applied."""
        def ok():
            w = self.w(e)
            return w["messages"] >= self.sent[e] and w["last_seq"] == seq and not w["replaying"]

        wait_until(ok, WAIT, msg=lambda: f"{e} settled at seq {seq}, {self.sent[e]} messages: {self.w(e)}")

    # ------------------------------------------------------------- checking

    def answers(self, index, prompts, keep_seq: bool = False) -> list[dict]:
        return [strip(index.match(prompt(i)).to_dict(), keep_seq) for i in prompts]

    def record(self, *prompts: int) -> None:
        for i, a in zip(prompts, self.answers(self.ix.index, prompts)):
            self.recorded[i] = a

    def check(self, baseline: dict[str, dict[str, int]]) -> None:
        ix, ref = self.ix, self.ref
        assert ix.running and ix.error is None, ix.error
        # Nothing indexed is lost: every recorded answer is the same.
        prompts = sorted(self.recorded)
        assert self.answers(ix.index, prompts) == [self.recorded[i] for i in prompts]
        # What the garbage did, it did exactly as the applier does offline, in seq order.
        assert self.answers(ix.index, prompts, True) == self.answers(ref, prompts, True)
        s, r = ix.stats(), ref.stats()
        for k in ("nodes", "resident_entries", "orphans", "workers", "stale_workers", "models", "events", "tiers"):
            assert s[k] == r[k], (k, s[k], r[k])
        for k in ("batches_applied", "sequence_gaps", "restarts"):
            assert s["counters"].get(k, 0) == r["counters"].get(k, 0), (k, s["counters"], r["counters"])
        # Drops counted per worker and per reason (R-DEC-3), exactly.
        want_total = Counter(r["dropped_payloads"]) + self.frame_drops + Counter(baseline["stats"])
        assert Counter(s["dropped_payloads"]) == want_total, (s["dropped_payloads"], want_total)
        live = {(w["engine"], w["dp_rank"]): w for w in ix.index.workers()}
        for rw in ref.workers():
            key = (rw["engine"], rw["dp_rank"])
            lw = dict(live.pop(key))
            want = Counter(rw["dropped"])
            if key in (("e1", 0), ("e2", 0)):
                want += Counter(baseline[key[0]])
            if key == ("e1", 0):
                want += self.frame_drops
            assert Counter(lw.pop("dropped")) == want, (key, want)
            lw.pop("last_event_age_s")
            assert lw == {k: v for k, v in rw.items() if k not in ("dropped", "last_event_age_s")}, key
        assert not live, f"workers the reference does not have: {sorted(live)}"
        # The stream: never stale, no gap, no restart, nothing buffered, no replay open.
        for e in ("e1", "e2"):
            w = self.w(e)
            assert not w["stale"] and w["restarts"] == 0 and w["gaps"] == 0 and w["replays_failed"] == 0, w
            assert not w["replaying"] and ix._subs[(e, 0)].pending == [], w
        assert self.w("e2")["dropped"] == baseline["e2"]
        # Bounded (R-BAD-3): orphans, tiers; labels are fixed names, never garbage.
        assert s["orphans"] <= MAX_ORPHANS
        assert len(s["tiers"]) <= ix.index.max_tiers
        labels = [*s["dropped_payloads"], *s["counters"], *s["events"].get("unknown", {})]
        labels += [k for w in ix.index.workers() for k in w["dropped"]]
        labels += [k for ev in s["events"].values() for k in ev]
        assert all(LABEL.fullmatch(k) for k in labels), labels
        assert set(s["events"].get("unknown", {})) <= ISSUES


def seed_index(live: Live) -> dict[str, dict[str, int]]:
    """Good batches first (GPU and CPU tiers, both layouts); every answer recorded."""
    live.subscribe()
    p = [prompt(i) for i in range(4)]
    live.good_batch("e1", [store(p[0], BS, 0, 4), store(p[1], BS, 0, 2)])
    live.good_batch("e1", [store(p[1], BS, 2, 4), store(p[2], BS, 0, 4), *chunks(p[2], BS, 2)])
    s1 = live.pub("e1").next_seq - 1
    live.good_batch("e2", [store(p[0], BS, 0, 4), store(p[BYSTANDER], BS, 0, 3)])
    live.settle("e1", s1)
    live.settle("e2", 0)
    live.record(*SEEDED, BYSTANDER)
    assert live.recorded[2]["workers"][0]["tiers"] == {"GPU": 4, "CPU": 4}
    assert live.recorded[0]["best"] is not None and len(live.recorded[0]["workers"]) == 2
    return {"e1": live.w("e1")["dropped"], "e2": live.w("e2")["dropped"], "stats": live.ix.stats()["dropped_payloads"]}


def fuzz(live: Live, baseline: dict[str, dict[str, int]], examples: int, *, derandomize: bool = True,
         seed: int | None = None) -> int:
    """The property; returns how many examples ran."""
    ran = [0]

    @settings(max_examples=examples, derandomize=derandomize, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(first=st.none() | OLD, rest=st.lists(MESSAGE, max_size=6))
    def one(first, rest) -> None:
        n = ran[0] = ran[0] + 1
        msgs = ([first] if first else []) + rest
        note(f"example {n}: {msgs!r}")
        for kind, m in msgs:
            if kind == "frames":
                live.raw("e1", m)
                live.frame_drops[frame_reason(m)] += 1
            elif kind == "next":
                live.publish("e1", m)
            else:  # an already used seq (R-STR-1), payload garbage with a ts not newer
                pick, payload = m
                live.raw("e1", [b"", seq8(pick % live.pub("e1").next_seq), payload])
        i = 100 + n
        seq = live.good_batch("e1", [store(prompt(i), BS, 0, 4)])
        live.settle("e1", seq)
        assert total(live.ix.index, prompt(i), "e1") == 4, "the good batch after the garbage"
        live.record(i)
        live.check(baseline)

    if seed is not None:
        one = hyp_seed(seed)(one)
    one()
    return ran[0]


@pytest.fixture
def live():
    lv = Live()
    try:
        yield lv
    finally:
        lv.close()


def test_R_DEC_3_R_BAD_3_fuzzed_malformed_messages_lose_nothing_and_are_counted(live):
    baseline = seed_index(live)
    live.check(baseline)
    assert fuzz(live, baseline, EXAMPLES) == EXAMPLES
    # The fuzzing really reached each kind of drop, and the decoder's slow path.
    s = live.ix.stats()
    assert {"bad_frame_count", "bad_seq_frame", "bad_payload"} <= set(s["dropped_payloads"]), s["dropped_payloads"]
    assert s["events"].get("unknown", {}).keys() & {"unknown_event_type", "malformed_event"}, s["events"]
    assert s["counters"].get("continuity_proven", 0) + s["counters"].get("batches_duplicate", 0) > 0


def test_the_fuzzer_can_fail(live):
    """The property notices a lost block: the same run, with one seeded block removed
    behind its back, fails on the first example."""
    baseline = seed_index(live)
    live.check(baseline)
    live.ix.index.reset_worker("e1", 0)  # loses every block of e1, as a bug would
    with pytest.raises(AssertionError):
        fuzz(live, baseline, 1)


# ------------------------------------------------- one engine, exact scenarios


class One:
    """One publisher (``e1``) and a live Indexer subscribed to it."""

    def __init__(self, replay: bool = True, **pub_kw: Any) -> None:
        self.pub = VllmPublisher(LOCAL, LOCAL if replay else None, **pub_kw)
        self.ix = Indexer([{"id": "e1", "endpoint": self.pub.live_endpoint,
                            "replay_endpoint": self.pub.bound_replay_endpoint}],
                          replay_timeout_s=WAIT, reconnect_ivl_max_ms=500)
        self.ix.start()

        def got():
            self.pub.send_raw([b"probe"])  # counted as bad_frame_count drops
            return self.w().get("messages")

        wait_until(got, WAIT, 0.02, msg="e1 receives")

    def w(self) -> dict:
        return next(w for w in self.ix.workers() if (w["engine"], w["dp_rank"]) == ("e1", 0))

    def settle(self, seq: int) -> None:
        wait_until(lambda: self.w()["last_seq"] == seq and not self.w()["replaying"], WAIT,
                   msg=lambda: f"e1 settled at seq {seq}: {self.w()}")

    def total(self, i: int) -> int:
        return total(self.ix.index, prompt(i), "e1")

    def close(self) -> None:
        err = self.ix.error
        self.ix.stop()
        self.pub.close()
        assert err is None, err


@pytest.fixture
def engine():
    made: list[One] = []

    def make(**kw: Any) -> One:
        made.append(One(**kw))
        return made[-1]

    yield make
    for o in made:
        o.close()


def test_R_STR_2_R_STR_5_R_BAD_3_forged_future_seq_costs_a_rebuild_never_an_entry(engine):
    """A well-formed message whose seq jumps far ahead (2**63) is a gap (R-STR-2): the
    replay cannot reach it, so the worker is stale, saying why, its index kept (R-STR-4).
    The engine's next real batch goes backwards with a newer ts: a restart (R-STR-5),
    rebuilt from a replay from seq 0: at the end nothing is lost and the worker is fresh."""
    o = engine()
    o.pub.publish([store(prompt(0), BS, 0, 4)], ts=BASE_TS)        # seq 0
    o.pub.publish([store(prompt(1), BS, 0, 4)], ts=BASE_TS + 1)    # seq 1
    o.settle(1)
    o.pub.send_raw([b"", seq8(2**63), b"\xc1 not msgpack"])
    wait_until(lambda: o.w()["stale"] and not o.w()["replaying"], WAIT, msg=lambda: o.w())
    w = o.w()
    assert "before batch 9223372036854775808" in w["stale_reason"], w
    assert (o.total(0), o.total(1)) == (4, 4)  # stale, its index kept
    o.pub.publish([store(prompt(2), BS, 0, 4)], ts=BASE_TS + 2)    # seq 2
    o.settle(2)
    w = o.w()
    assert not w["stale"] and w["restarts"] == 1 and w["replays_failed"] == 1, w
    assert (o.total(0), o.total(1), o.total(2)) == (4, 4, 4)
    assert o.ix.running


# ------------------------------------------------------ bugs the fuzzing found (fixed)

DEEP_PAYLOAD = msgspec.msgpack.encode([BASE_TS, [msgspec.Raw(b"\x91" * 5000 + b"\xc0")], 0])


def test_R_DEC_3_R_BAD_3_deeply_nested_payload_is_a_bad_payload_not_a_lost_seq(engine):
    o = engine(replay=False)
    o.pub.publish([store(prompt(0), BS, 0, 4)])                   # seq 0
    o.settle(0)
    o.pub.publish_payload(DEEP_PAYLOAD)                           # seq 1: [ts, [[[[...5000 deep]]]], 0]
    o.pub.publish([store(prompt(1), BS, 0, 4)])                   # seq 2
    o.settle(2)
    w = o.w()
    assert (o.total(0), o.total(1)) == (4, 4)
    assert w["dropped"].get("bad_payload") == 1 and "internal_error" not in w["dropped"], w["dropped"]
    assert not w["stale"] and w["gaps"] == 0, w
    assert PrefixIndex().apply("e1", DEEP_PAYLOAD, seq=0) == "dropped"


def test_R_APP_10_R_BAD_3_a_rejected_store_in_a_new_group_changes_no_answer(engine):
    o = engine()
    o.pub.publish([store(prompt(0), BS, 0, 4)])                   # seq 0
    o.settle(0)
    before = strip(o.ix.match(prompt(0)).to_dict())
    assert before["workers"][0]["total_blocks"] == 4
    # Token 2**32 is no uint32 token id: the store is rejected as a whole (R-BAD-3).
    bad = Stored(block_hashes=[12345], parent_block_hash=None, token_ids=[1, 2, 3, 2**32], block_size=BS,
                 group_idx=7)
    o.pub.publish([bad])                                          # seq 1
    o.pub.publish([store(prompt(1), BS, 0, 4)])                   # seq 2
    o.settle(2)
    assert o.ix.stats()["events"]["BlockStored"].get("bad_tokens") == 1
    assert strip(o.ix.match(prompt(0)).to_dict()) == before
    assert o.total(1) == 4


def test_R_APP_7_R_BAD_3_a_rejected_first_store_fixes_no_block_size(engine):
    o = engine()
    bad = Stored(block_hashes=[12345], parent_block_hash=None, token_ids=[1] * 7 + [2**32], block_size=8)
    o.pub.publish([bad])                                          # seq 0
    o.pub.publish([store(prompt(0), BS, 0, 4)])                   # seq 1
    o.settle(1)
    assert o.ix.stats()["events"]["BlockStored"].get("bad_tokens") == 1
    assert o.total(0) == 4, o.ix.stats()["events"]


def test_R_STR_7_R_BAD_3_a_nan_ts_batch_is_a_bad_payload_and_breaks_no_continuity_proof(engine):
    # A batch's ts orders restarts and proves continuity: a NaN (never equal to itself)
    # once anchored a proof that then took the engine for restarted. Now such a batch
    # is a counted bad payload, and the anchor stays on the last batch applied.
    o = engine(buffer_steps=3)
    o.pub.publish([store(prompt(0), BS, 0, 4)], ts=BASE_TS)       # seq 0
    o.pub.publish([store(prompt(1), BS, 0, 4)], ts=BASE_TS + 1)   # seq 1
    o.pub.publish_payload(encode_batch([], ts=math.nan))          # seq 2: an empty batch, ts NaN
    o.settle(2)
    assert (o.total(0), o.total(1)) == (4, 4)
    assert o.w()["dropped"].get("bad_payload") == 1
    # An old seq again (garbage): not trusted before a replay from the anchor proves the
    # engine is the same incarnation (R-STR-7). The ring still holds the anchor (seq 1).
    o.pub.send_raw([b"", seq8(0), b"\xc1"])
    o.pub.publish([store(prompt(2), BS, 0, 4)], ts=BASE_TS + 3)   # seq 3
    o.settle(3)
    w = o.w()
    assert (o.total(0), o.total(1), o.total(2)) == (4, 4, 4)
    assert not w["stale"] and w["restarts"] == 0, w
    assert PrefixIndex().apply("e1", encode_batch([], ts=math.inf), seq=0) == "dropped"


def test_R_APP_4_R_BAD_3_ignored_removals_take_no_tier(engine):
    o = engine()
    junk = [removed([10**6 + i], medium=f"junk{i}") for i in range(o.ix.index.max_tiers - 1)]
    o.pub.publish(junk)                                           # seq 0: every removal ignored
    o.pub.publish([store(prompt(0), BS, 0, 4), *chunks(prompt(0), BS, 2)])  # seq 1: GPU, then CPU chunks
    o.settle(1)
    assert o.ix.stats()["events"]["BlockRemoved"] == {"unknown_hash": len(junk)}
    assert o.ix.match(prompt(0)).worker("e1").tiers == {"GPU": 4, "CPU": 4}
