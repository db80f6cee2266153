"""A fleet of real vLLM engines behind a real ``kv-indexer serve``, and the claim check.

The check: for every request, ``/v1/route`` (no load) picks an engine and claims the
prefix it holds; the request then goes to that engine, whose own
``usage.prompt_tokens_details.cached_tokens`` is the truth. The claim is what vLLM
could reuse of what the index says is cached: ``min(cached_blocks, (len - 1) // bs) *
bs`` (vLLM never reuses the whole prompt). The reference is the engine itself; nothing
here shares code with the index.

Between requests the test waits, by probing ``/v1/match``, until the index holds the
prompt it just sent on the engine that served it (the engine published the step's
batch; the store, and the removals of the same step before it, are applied): routing
is then judged on a current index, and the figure is about correctness, not lag.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from svc import Server, wait_until
from vllm_engine import VllmEngine

# Words the test tokenizer was trained on (tests/textkit.py) and some it was not.
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "KV", "caches", "hold", "keys", "and", "values", "of", "every", "prompt", "token", "routing", "by", "prefix", "reuses", "them", "Grüße", "aus", "Köln", "Ça", "va", "smørrebrød", "日本語", "テキスト", "中文", "한국어", "emoji", "😀", "🚀", "math", "∑", "√", "≤", "arrows", "→", "←", "helpful", "assistant", "answer", "briefly", "precisely", "user", "system", "tool", "zebra", "quantum", "lattice", "orbit", "vector"]


def start_engines(engines: list[VllmEngine]) -> None:
    """Start every engine at once (they boot in parallel), then wait for all."""
    for e in engines:
        e.start()
    for e in engines:
        e.wait_up()


def start_index(engines: list[VllmEngine], tokenizer_dir: str | None = None, *extra: str) -> Server:
    args = [a for e in engines for a in ("--engine", e.config())]
    if tokenizer_dir is not None:
        args += ["--tokenizer", f"{engines[0].model}={tokenizer_dir}"]
    srv = Server(*args, *extra)  # log level info: svc.Server reads the bound port from uvicorn's start-up line
    wait_until(lambda: all(w.get("connected") for w in srv.client.get("/v1/workers")[1]),
               timeout=30, msg="index subscribed to every engine")
    return srv


@dataclass
class Tally:
    """Exact claims per kind of request."""

    n: Counter[str] = field(default_factory=Counter)
    exact: Counter[str] = field(default_factory=Counter)
    misses: list[dict[str, Any]] = field(default_factory=list)
    routed: Counter[str] = field(default_factory=Counter)
    reused_tokens: int = 0

    def add(self, kind: str, claim: int, truth: int, detail: dict[str, Any]) -> None:
        self.n[kind] += 1
        if claim == truth:
            self.exact[kind] += 1
        else:
            self.misses.append({"kind": kind, "claim": claim, "truth": truth, **detail})
        self.reused_tokens += truth

    @property
    def total(self) -> int:
        return sum(self.n.values())

    @property
    def total_exact(self) -> int:
        return sum(self.exact.values())

    def line(self) -> str:
        per = ", ".join(f"{k} {self.exact[k]}/{self.n[k]}" for k in sorted(self.n))
        over = sum(m["claim"] > m["truth"] for m in self.misses)
        return (f"{self.total_exact}/{self.total} exact ({per}; over-claimed {over}, under-claimed "
                f"{len(self.misses) - over}); routed {dict(self.routed)}; {self.reused_tokens} tokens reused")


class Workload:
    """Conversations that share system prompts and grow turn by turn, as token ids,
    salted token ids, text prompts and chat messages (seeded: every run the same)."""

    def __init__(self, seed: int, block_size: int, max_len: int, kinds: dict[str, int]) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.max_len = max_len
        self.kinds = kinds
        self.systems = [self._ids(self.rng.randrange(2 * block_size, 5 * block_size)) for _ in range(5)]
        self.sessions: dict[str, list[Any]] = {k: [] for k in kinds}

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 590) for _ in range(n)]

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def next(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """(kind, the index's request body, the engine's request body)."""
        kind = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
        pool = self.sessions[kind]
        if not pool or (len(pool) < 6 and self.rng.random() < 0.3):
            pool.append(self._new(kind))
        i = self.rng.randrange(len(pool))
        s = self._grow(kind, pool[i])
        if s is None:  # too long: this conversation ends, a new one takes its place
            pool[i] = self._new(kind)
            s = pool[i]
        else:
            pool[i] = s
        return kind, *self._bodies(kind, s)

    def _new(self, kind: str) -> Any:
        sys_ids = self.rng.choice(self.systems)
        if kind == "tokens":
            return {"ids": list(sys_ids)}
        if kind == "salt":
            return {"ids": list(sys_ids), "salt": self.rng.choice(["tenant-a", "tenant-b"])}
        if kind == "prompt":
            return {"text": self._words(self.rng.randrange(20, 60))}
        return {"messages": [{"role": "system", "content": self._words(self.rng.randrange(15, 40))},
                             {"role": "user", "content": self._words(self.rng.randrange(5, 30))}]}

    def _grow(self, kind: str, s: Any) -> Any:
        if self.rng.random() < 0.25:
            return s  # the same prompt again (a retry, a shared question)
        if kind in ("tokens", "salt"):
            ids = s["ids"] + self._ids(self.rng.randrange(8, 3 * self.bs))
            return None if len(ids) > self.max_len - 16 else {**s, "ids": ids}
        if kind == "prompt":
            text = s["text"] + " " + self._words(self.rng.randrange(5, 40))
            return None if len(text) > 2 * self.max_len else {"text": text}
        msgs = s["messages"] + [{"role": "assistant", "content": self._words(self.rng.randrange(3, 20))},
                                {"role": "user", "content": self._words(self.rng.randrange(3, 25))}]
        return None if sum(len(m["content"]) for m in msgs) > 2 * self.max_len else {"messages": msgs}

    @staticmethod
    def _bodies(kind: str, s: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if kind in ("tokens", "salt"):
            ix: dict[str, Any] = {"token_ids": s["ids"]}
            eng: dict[str, Any] = {"prompt": s["ids"]}
            if kind == "salt":
                ix["cache_salt"] = eng["cache_salt"] = s["salt"]
            return ix, eng
        if kind == "prompt":
            return {"prompt": s["text"]}, {"prompt": s["text"]}
        return {"messages": s["messages"]}, {"messages": s["messages"]}


def held_blocks(srv: Server, model: str, body: dict[str, Any], engine: str) -> int:
    st, m = srv.client.post("/v1/match", {"model": model, **body})
    assert st == 200, m
    for w in m["workers"]:
        if w["engine"] == engine:
            # The deepest group's own prefix: a hybrid model's headline is what vLLM
            # would reuse of this very prompt (never all of it), its full-attention
            # group holds every block stored.
            return max([int(w["total_blocks"])] + [int(g["total_blocks"]) for g in w["groups"].values()])
    return 0


def routed_request(srv: Server, engines: dict[str, VllmEngine], model: str, kind: str,
                   ix_body: dict[str, Any], eng_body: dict[str, Any], tally: Tally) -> dict[str, Any]:
    """Route one request by the index, send it to the chosen engine, tally the claim
    against the engine's cached_tokens, and wait until the index holds
    what the engine now caches of it: all its full blocks in the full-attention group
    (a hybrid model's sliding-window group comes in the same batch)."""
    st, r = srv.client.post("/v1/route", {"model": model, "max_tokens": 1, **ix_body})
    assert st == 200, r
    chosen = r["engine"]
    blocks = r["ranked"][0]["cached_blocks"]
    assert r["ranked"][0]["engine"] == chosen
    eng = engines[chosen]
    usage = eng.complete(eng_body)
    n = usage["prompt_tokens"]
    truth = usage["prompt_tokens_details"]["cached_tokens"]
    bs = eng.block_size
    claim = min(blocks, (n - 1) // bs) * bs
    tally.routed[chosen] += 1
    tally.add(kind, claim, truth, {"engine": chosen, "len": n, "cached_blocks": blocks})
    want = n // bs
    deadline = time.monotonic() + 15
    while held_blocks(srv, model, ix_body, chosen) < want:
        assert time.monotonic() < deadline, f"index never showed {want} blocks of the prompt on {chosen}"
        time.sleep(0.01)
    return {"engine": chosen, "claim": claim, "truth": truth, "len": n, "request_id": r["request_id"]}


def run_routed(srv: Server, engines: dict[str, VllmEngine], model: str, work: Workload, n: int,
               tally: Tally | None = None, overlap: int = 3) -> Tally:
    """``n`` routed requests of ``work``. Each route's ``done`` is sent ``overlap``
    requests later, as if that many were still decoding: the index's own in-flight load
    then spreads new conversations over the engines (with every request ended at once,
    an idle fleet's ties all go to the first engine)."""
    tally = tally or Tally()
    open_: list[str] = []
    for _ in range(n):
        kind, ix_body, eng_body = work.next()
        got = routed_request(srv, engines, model, kind, ix_body, eng_body, tally)
        open_.append(got["request_id"])
        while len(open_) > overlap:
            st, _ = srv.client.post(f"/v1/route/{open_.pop(0)}/done", {})
            assert st == 200
    for rid in open_:
        srv.client.post(f"/v1/route/{rid}/done", {})
    return tally


def report(name: str, tally: Tally) -> str:
    line = f"{name}: {tally.line()}"
    out = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "real-engines.txt", "a", encoding="utf-8") as f:
        f.write(line + "\n")
    print(line)
    return line
