"""Test-only helpers that load third-party code from where its own package installed it."""
