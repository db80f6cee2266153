"""Captures a real vLLM engine's ``/metrics`` into ``tests/data/vllm-metrics/``: once idle,
once busy (more requests than ``--max-num-seqs``, so some wait). The scraper's tests
read these captures instead of hand-written expositions.

Usage: ``python tests/e2e/real/capture_metrics.py URL MODEL`` with an engine started with
``--max-num-seqs 2`` (any engine works; the busy capture needs requests to queue).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "data" / "vllm-metrics"


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "idle.txt").write_text(scrape(url))

    def one(i: int) -> None:
        body = {"model": model, "prompt": [10 + (i * 7 + j) % 500 for j in range(300)], "max_tokens": 400,
                "ignore_eos": True}
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        urllib.request.urlopen(req, timeout=300).read()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    busy = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = scrape(url)
        waiting = re.search(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        if waiting and running and float(waiting.group(1)) > 0 and float(running.group(1)) > 0:
            busy = text
            break
        time.sleep(0.05)
    for t in threads:
        t.join()
    if not busy:
        raise SystemExit("no scrape with requests both running and waiting")
    (OUT / "busy.txt").write_text(busy)
    print(OUT)


if __name__ == "__main__":
    main()
