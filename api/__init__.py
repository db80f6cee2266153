"""The HTTP service around :mod:`indexer` (FastAPI app, settings, CLI).

Built by the service issue; the core library never imports from here.
"""
