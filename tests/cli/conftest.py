"""Fixtures for the ``xla-ckpt`` command tests: a location on each backend, an in-process runner.

``root`` is a fresh location on the local disk or on the GCS emulator
(``gs://``), so every command test runs against both.  ``cli(*argv)`` runs
``xla_ckpt.cli.main.main`` in this process and returns the exit code and
what it printed.
"""

from dataclasses import dataclass

import pytest

from xla_ckpt.cli.main import main


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    def run(*argv: str) -> Result:
        capsys.readouterr()
        code = main(["--no-progress", *argv])
        got = capsys.readouterr()
        return Result(code, got.out, got.err)

    return run


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    """A fresh, empty location: a local folder path or a ``gs://`` prefix on the emulator."""
    if request.param == "local":
        path = tmp_path / "root"
        path.mkdir()
        return str(path)
    return request.getfixturevalue("gcs_uri")
