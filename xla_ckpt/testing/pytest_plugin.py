"""pytest fixtures for users and for our own tests (registered in tests/conftest.py).

Usable from any project: add ``pytest_plugins = ["xla_ckpt.testing.pytest_plugin"]``.
"""
