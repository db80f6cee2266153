"""The service's compiled wire formats (``api/_surface.c``, built as ``api._surface``)
against their references.

* ``split_tokens_json`` takes exactly a JSON object whose ``token_ids`` is a plain
  array of uint32 and declines everything else, keeping the other members verbatim;
* the request decoder's C path gives the typed decoder's answer or error;
* ``dynamo_answer`` makes the bytes msgspec makes of api.dynamo's document;
* without the module (``KVI_PURE_PYTHON=1``) ``api.surface`` gives the pure paths.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("KVI_PURE_PYTHON", "") not in ("", "0"):
    pytest.skip("the pure-Python build: nothing compiled to compare", allow_module_level=True)


def test_the_compiled_formats_are_built_and_used() -> None:
    """The install builds api._surface (a missing compiler only warns: this catches that),
    and the service's doors call it."""
    from api import dynamo, jsonroutes, surface
    from api.routes import query

    assert surface.COMPILED
    assert jsonroutes.split_json_tokens.__module__ == "api._surface"
    assert query.split_json_tokens.__module__ == "api._surface"
    assert dynamo._dynamo_answer is not None and dynamo._dynamo_answer.__module__ == "api._surface"


from api import _surface  # noqa: E402  (after the check above names what is missing)


def test_without_the_module_the_pure_paths_answer() -> None:
    """KVI_PURE_PYTHON=1 (or no compiler): no split (the typed decoder reads every body),
    and Dynamo's body is msgspec's encoding of its document, the same bytes."""
    env = dict(os.environ, KVI_PURE_PYTHON="1")
    code = (
        "from types import SimpleNamespace\n"
        "from api import surface\n"
        "from api.dynamo import Dynamo\n"
        "print(surface.COMPILED, surface.split_json_tokens(b'{\"token_ids\": [1]}'), surface.dynamo_answer)\n"
        "res = SimpleNamespace(workers=[(-1.0, -2, 'e', 0, (('GPU', 2),), (), 32, (False, None), 0.0)], block_size=16)\n"
        "print(Dynamo.answer(res).decode())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    first, body = r.stdout.splitlines()
    assert first == "False None None"
    rows = [(-1.0, -2, "e", 0, (("GPU", 2),), (), 32, (False, None), 0.0)]
    assert body.encode() == _surface.dynamo_answer(rows, 16)


ANY_INTS = st.lists(st.integers(-(2**40), 2**40), max_size=40)


@given(ANY_INTS)
@settings(max_examples=300, deadline=None)
def test_json_split_takes_exactly_plain_uint32_arrays(toks) -> None:
    ok = all(0 <= t <= 2**32 - 1 for t in toks)
    packed = struct.pack(f"<{len(toks)}I", *toks) if ok else None
    want = (b"{}", packed) if ok and toks else None  # an empty array: the typed decoder decides
    assert _surface.split_tokens_json(msgspec.json.encode({"token_ids": toks})) == want
    assert _surface.split_tokens_json(json.dumps({"token_ids": toks}, indent=1).encode()) == want


def test_json_split_keeps_every_other_member_verbatim() -> None:
    body = b' { "model" : "m]", "token_ids" : [ 7 , 0,4294967295 ] , "x": {"y": [1, "]\\\"", {}]}, "n": -1.5e3 } '
    rest, toks = _surface.split_tokens_json(body)
    assert toks == struct.pack("<3I", 7, 0, 2**32 - 1)
    assert json.loads(rest) == {"model": "m]", "x": {"y": [1, ']"', {}]}, "n": -1.5e3}  # an escaped quote
    assert _surface.split_tokens_json(b'{"token_ids":[1]}') == (b"{}", struct.pack("<I", 1))


@pytest.mark.parametrize("body", [
    b'{"token_ids": [01]}', b'{"token_ids": [1,]}', b'{"token_ids": [,1]}', b'{"token_ids": [1 2]}',
    b'{"token_ids": [1]}x', b'{"token_ids": [1e3]}', b'{"token_ids": [1.0]}', b'{"token_ids": [-0]}',
    b'{"token_ids": []}', b'{"token_ids": [99999999999]}', b'{"token_ids": [4294967296]}',
    b'{"token_ids": ["1"]}', b'{"token_ids": [true]}', b'{"token_ids": [null]}', b'{"token_ids": [[1]]}',
    b'{"token_ids": null}', b'{"token_ids": [1], "token_ids": [2]}', b'{"token\\u005fids": [1]}',
    b'{"model": "m"}', b'{"model": "m" "x", "token_ids": [1]}', b'{"model": "m",, "token_ids": [1]}',
    b'{"model": "m", "token_ids": [1],}', b'{"token_ids": [1]', b"[1, 2]", b"", b"{", b'{"a": [1}, "token_ids": [1]',
    b'{"a": "unterminated, "token_ids": [1]}',
])
def test_json_split_declines_what_is_not_a_plain_body(body) -> None:
    assert _surface.split_tokens_json(body) is None


@pytest.mark.parametrize("text", ["0", "9", "999999999", "1000000000", "4294967295", "4294967296", "9999999999",
                                  "10000000000", "00", "007", "18446744073709551621", "36893488147419103237",
                                  "99999999999999999999999"])
def test_json_split_reads_every_length_of_number(text) -> None:
    """Digits are read with no check per digit: a number is bounded by its length, so one
    that wraps 2**64 (the last two: 2**64 + 5 and 2**65 + 5) is still refused."""
    v = int(text)
    ok = 0 <= v < 2**32 and (text == "0" or not text.startswith("0"))
    want = (b"{}", struct.pack("<2I", 1, v)) if ok else None
    assert _surface.split_tokens_json(b'{"token_ids": [1, ' + text.encode() + b"]}") == want


@given(st.binary(max_size=300))
@settings(max_examples=1000, deadline=None)
def test_json_split_survives_any_bytes(raw) -> None:
    """Whatever a client sends reaches this reader: never a crash."""
    split = _surface.split_tokens_json(raw)
    assert split is None or (len(split[1]) % 4 == 0 and split[0][:1] == b"{" and split[0][-1:] == b"}")
    for text in (b'{"token_ids": [' + raw + b"]}", b'{"token_ids": [1], "m": ' + raw + b"}"):
        split = _surface.split_tokens_json(text)
        assert split is None or len(split[1]) % 4 == 0


BODIES = [
    b'{"token_ids": [1, 2, 3]}',
    b'{"model": "m", "token_ids": [5], "model": "n"}',
    b'{"token_ids": [1], "load": {"e/0": {"active_prefill_tokens": 3}}, "candidates": ["e/0"]}',
    b'{"token_ids": [1], "load": {"e/0": {"active_prefill_tokens": -3}}}',
    b'{"token_ids": [1], "model": null}',
    b'{"token_ids": [1, 2, 3], "model": "m", "lora_name": "l", "cache_salt": "s"}',
    b'{"model": "m", "token_ids": [4294967295, 0]}',
    b'{"token_ids": [1.0, 2]}',  # integral floats: the typed decoder reads them
    b'{"token_ids": []}',
    b'{"token_ids": [-1]}',
    b'{"token_ids": [4294967296]}',
    b'{"token_ids": [1], "model": ""}',
    b'{"token_ids": [1], "unknown": 1}',
    b'{"token_ids": "abc"}',
    b'{"token_ids": [1]',
    b"[]",
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("rtype", ["MatchRequest", "RouteRequest", "DynQuery"])
def test_request_decoder_c_path_equals_typed_decode(body, rtype) -> None:
    from api import schemas
    from api.jsonroutes import JsonRoute as _Route, decode as _decode

    async def handler(q):  # pragma: no cover - never called
        return 200, {}

    cls = schemas.REQUEST_TYPES[rtype]
    if rtype == "DynQuery":
        body = body.replace(b"{", b'{"model_name": "m", ', 1) if body.startswith(b"{") else body
    fast = _Route("/x", cls, handler, True, "detail")
    typed = _Route("/x", cls, handler, True, "detail")
    typed.rest_decoder = None

    def outcome(route):
        try:
            q = _decode(route, body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return type(e).__name__, str(e)
        t = q.token_ids
        toks = list(struct.unpack(f"<{len(t) // 4}I", t)) if t.__class__ is bytes else list(t)
        return {f: getattr(q, f) for f in cls.__struct_fields__ if f != "token_ids"}, toks

    assert outcome(fast) == outcome(typed)


_EID = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_TIER = st.sampled_from(["GPU", "CPU", "STORAGE", "DISK"])


@given(
    st.lists(st.tuples(_EID, st.integers(0, 300)), unique=True, max_size=40),
    st.data(),
    st.sampled_from([0, 1, 16, 64]),
)
@settings(max_examples=300, deadline=None)
def test_R_Q_2_dynamo_answer_is_the_documents_bytes(workers, data, bs) -> None:
    """The compiled /query body equals msgspec's encoding of api.dynamo's document: the
    per-engine merge over dp ranks, the scores' order, the cpu rule, string escapes."""
    from types import SimpleNamespace

    from api.common import ENC
    from api.dynamo import Dynamo

    rows = []
    for eid, dp in workers:
        total = data.draw(st.integers(0, 5000))
        items = tuple((name, data.draw(st.integers(0, total)))
                      for name in data.draw(st.lists(_TIER, unique=True, max_size=3)))
        rows.append((-total * 1.5, -total, eid, dp, items, (), total * bs, (False, None), 0.0))
    res = SimpleNamespace(workers=rows, block_size=bs or None)
    assert _surface.dynamo_answer(rows, bs) == ENC.encode(Dynamo.answer_doc(res))


def test_dynamo_answer_refuses_what_is_not_a_match() -> None:
    with pytest.raises(TypeError):
        _surface.dynamo_answer([("not", "a", "match")], 16)
    with pytest.raises(TypeError):
        _surface.dynamo_answer([(0, -1, "e", 0, "GPU")], 16)
    assert _surface.dynamo_answer([], 16) == b'{"scores":{},"frequencies":[],"instances":{}}'
