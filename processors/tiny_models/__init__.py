"""Tiny random models for tests and the no-download demo (no weights leave or enter the repo)."""
