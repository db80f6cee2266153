"""NVIDIA Dynamo standalone indexer routes (``python -m dynamo.indexer``), same shapes."""

from __future__ import annotations


def add_routes(app, svc, json_route) -> None:
    pass
