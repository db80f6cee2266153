"""indexer._native._prefault: pymalloc arenas from a reserve a background thread keeps faulted in.

The allocator is process-wide and stays for the life of the process, so each check
runs in a child interpreter of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from svc import Server

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_arenas_come_from_the_reserve_and_go_back_to_it():
    out = _child("""
        import threading
        import time

        from indexer._native import _prefault as p

        assert p.install(4) is True
        # A new thread's first frame stack chunk (16 KiB) comes from the same allocator
        # before any new arena (as in the service): it must not be taken for the arena size.
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        # 400k distinct tuples (~56 MB of pymalloc blocks): dozens of new arenas.
        xs = [(i, i * 7) for i in range(400_000)]
        s = p.stats()
        assert s["installed"] and s["target"] == 4 and s["arena_size"] > 0, s
        assert s["hits"] > 0, s                     # arenas were taken from the reserve
        assert s["filled"] >= s["hits"], s           # ... which the thread had mapped
        assert sum(a + b for a, b in xs) == sum(i * 8 for i in range(400_000))  # the memory holds
        del xs
        s2 = p.stats()
        assert s2["recycled"] > 0, s2               # freed arenas kept, up to twice the target
        assert s2["held"] <= 8, s2
        ys = [(i, -i) for i in range(200_000)]      # recycled arenas serve the next growth
        assert all(a == -b for a, b in ys)
        deadline = time.monotonic() + 5
        while p.stats()["held"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(p.stats()["held"])
    """)
    assert int(out.split()[-1]) >= 4  # the thread refills the reserve to its target


def test_reserve_size_is_checked_and_a_second_install_only_resizes():
    out = _child("""
        from indexer._native import _prefault as p

        for bad in (0, 129, -1):
            try:
                p.install(bad)
            except ValueError as e:
                print("refused", bad, e)
            else:
                raise SystemExit(f"install({bad}) was accepted")
        assert p.stats()["installed"] is False   # nothing installed by a refused call
        assert p.install(2) and p.install(6)
        print("target", p.stats()["target"])
    """)
    assert out.count("refused") == 3 and "1..128" in out
    assert out.split()[-1] == "6"


def test_the_service_runs_the_prefault_thread():
    s = Server()
    try:
        task = Path(f"/proc/{s.proc.pid}/task")
        names = {(t / "comm").read_text().strip() for t in task.iterdir()}
        assert "kvi-prefault" in names, names
    finally:
        s.stop()


def test_a_library_process_is_left_alone():
    """Importing the index changes no allocator: only the service (or a caller) installs."""
    out = _child("""
        import indexer
        from indexer._native import _prefault as p
        idx = indexer.PrefixIndex()
        print(p.stats()["installed"])
    """)
    assert out.split()[-1] == "False"
