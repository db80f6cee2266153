"""The service's wire formats in C (``api/_surface.c``, built as ``api._surface``) when
built, else their pure-Python paths: the same answers either way.

They are the HTTP service's, not the index's: a request's JSON body and Dynamo's
``/query`` body. Like the index's compiled core, the module is optional (an install
without a C compiler) and ``KVI_PURE_PYTHON=1`` turns it off, so the pure build runs
every pure path at once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from indexer._native import compiled

_surface: ModuleType | None = compiled("api._surface")

COMPILED = _surface is not None


def _no_split(body: bytes) -> tuple[bytes, bytes] | None:
    """Without the compiled split: the caller's typed decoder reads the whole body."""
    return None


# A request body (a JSON object with a ``token_ids`` array) split in one pass into
# ``(the other members as a JSON object, the tokens as little-endian uint32 bytes)``, with
# no Python int per token. None when the body is anything else, or without the compiled
# module: the caller's typed decoder then reads the whole body. The compiled call itself
# when built (no wrapper frame on the hot doors).
split_json_tokens: Callable[[bytes], tuple[bytes, bytes] | None] = (
    _surface.split_tokens_json if _surface is not None else _no_split
)

# Dynamo's /query body from a match's WorkerMatch tuples and block size; None without the
# compiled module (api.dynamo then encodes Dynamo.answer_doc, its reference, with msgspec).
dynamo_answer: Callable[[list[Any], int], bytes] | None = _surface.dynamo_answer if _surface is not None else None
