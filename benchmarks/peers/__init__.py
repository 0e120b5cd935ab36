"""Peers of ``benchmarks/gcs_restore.py`` that run in virtualenvs of their own (see each module)."""
