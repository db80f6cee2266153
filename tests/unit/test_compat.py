"""The old module paths of the flat layout (``indexer._compat``): each still imports, warns
with a DeprecationWarning that names its new path, and is the new module itself. The suite
turns every warning into an error, so no other test may use an old path."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from indexer._compat import MOVED


@pytest.mark.parametrize("old, new", [("indexer.keys", "indexer.wire.keys"), ("indexer.tree", "indexer.store.tree"),
                                      ("indexer.jetstream", "indexer.ingest.jetstream")])
def test_an_old_module_path_warns_and_gives_the_new_module(old, new, monkeypatch):
    assert MOVED[old] == new
    current = importlib.import_module(new)
    # Only a first import warns: forget an earlier one (monkeypatch puts it back after).
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)};"):
        module = importlib.import_module(old)
    assert module is current


def test_a_name_from_an_old_module_path_is_the_new_one(monkeypatch):
    from indexer.wire import keys

    monkeypatch.delitem(sys.modules, "indexer.keys", raising=False)
    with pytest.warns(DeprecationWarning, match=r"^indexer\.keys moved to indexer\.wire\.keys;"):
        from indexer.keys import block_keys
    assert block_keys is keys.block_keys


def test_an_old_module_now_a_package_serves_its_names_with_a_warning():
    import indexer.wire
    from indexer.wire import decode

    with pytest.warns(DeprecationWarning,
                      match=r"^indexer\.wire\.decode_batch moved to indexer\.wire\.decode\.decode_batch;"):
        value = indexer.wire.decode_batch
    assert value is decode.decode_batch


def test_the_publisher_at_the_package_root_warns_and_is_the_producers():
    import indexer
    from indexer.producer.publisher import VllmPublisher

    with pytest.warns(DeprecationWarning, match=r"^indexer\.VllmPublisher moved to "
                                                r"indexer\.producer\.publisher\.VllmPublisher;"):
        value = indexer.VllmPublisher
    assert value is VllmPublisher
