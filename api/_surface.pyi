"""Type stub for the compiled service formats (``api/_surface.c``).

The C module has no pure-Python source, so this file is what type checkers see;
``python -m mypy.stubtest api._surface`` checks it against the built module. The
references the C is held to are ``api.dynamo.Dynamo.answer_doc`` encoded by msgspec
(``dynamo_answer``) and the routes' typed decoders (``split_tokens_json``: whatever
it declines, they read). Every function takes positional arguments only.
"""

from typing import Any

from typing_extensions import Buffer

def dynamo_answer(workers: list[Any], block_size: int, /) -> bytes:
    """Dynamo's /query body (JSON) from a match's ranked WorkerMatch tuples."""

def split_tokens_json(body: Buffer, /) -> tuple[bytes, bytes] | None:
    """A JSON request body split into ``(other members as a JSON object, token_ids as
    little-endian uint32 bytes)``; None when it is anything else."""
