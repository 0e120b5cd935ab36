"""The ``xla-ckpt`` entry point: commands listed, one-line errors, ``--debug`` tracebacks,
exit codes of the installed console script, progress bars only when asked or on a TTY.
"""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import flip_byte

import xla_ckpt
from xla_ckpt.cli import common
from xla_ckpt.cli.main import COMMANDS, build_parser, main
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io import read_manifest
from xla_ckpt.storage import open_storage

OPERATOR_COMMANDS = ["ls", "inspect", "verify", "convert", "rm", "gc"]


def test_commands_are_registered_in_order():
    assert list(COMMANDS)[:6] == OPERATOR_COMMANDS  # others (export, demo, train) follow
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sub.choices is not None
    assert list(sub.choices)[:6] == OPERATOR_COMMANDS


def test_help_version_and_usage_errors(capsys):
    assert main(["--help"]) == 0
    assert "verify" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"xla-ckpt {xla_ckpt.__version__}\n"
    assert main([]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main(["verify", "--no-such-flag", "x"]) == 2


def test_errors_are_one_line_without_traceback_unless_debug(cli, tmp_path):
    missing = str(tmp_path / "missing")
    r = cli("inspect", missing)
    assert r.code == 2 and r.err == (f"xla-ckpt inspect: error: {missing}: no checkpoint here "
                                     f"({MANIFEST_NAME} not found)\n")
    for argv in (("--debug", "inspect", missing), ("inspect", missing, "--debug")):
        r = cli(*argv)
        assert r.code == 2
        assert "Traceback (most recent call last)" in r.err and "CheckpointNotFoundError" in r.err
        assert r.err.rstrip().splitlines()[-1].startswith("xla-ckpt inspect: error: ")


def test_unexpected_exceptions_are_reported_as_internal_errors(cli, tmp_path, monkeypatch):
    xla_ckpt.save({"w": torch.ones(1)}, str(tmp_path / "ck"))
    from xla_ckpt.cli import inspect as inspect_cmd

    def boom(trees):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(inspect_cmd, "summarize", boom)
    r = cli("inspect", str(tmp_path / "ck"))
    assert r.code == 1
    assert r.err == ("xla-ckpt inspect: error: internal error (ZeroDivisionError: bug); rerun "
                     "with --debug\n")


def test_exit_code_mapping():
    from xla_ckpt import errors as E

    assert common.exit_code_for(E.CheckpointNotFoundError("x")) == 2
    assert common.exit_code_for(E.IncompleteCheckpointError("x")) == 1
    assert common.exit_code_for(E.StoragePermissionError("x")) == 2
    assert common.exit_code_for(E.StorageError("x")) == 2
    assert common.exit_code_for(E.ConfigError("x")) == 2
    assert common.exit_code_for(common.UsageError("x")) == 2
    assert common.exit_code_for(E.IntegrityError("x")) == 1
    assert common.exit_code_for(E.UnsafePickleError("x")) == 1
    assert common.exit_code_for(PermissionError("x")) == 2
    assert common.exit_code_for(ValueError("x")) == 1


def test_progress_bar_draws_only_when_enabled(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    bar = common.progress_bar(2048, "verify", enabled=True)
    bar.update(1024)
    bar.update(1024)
    bar.refresh()  # draws now (updates within mininterval are drawn lazily)
    bar.close()
    assert "verify" in buf.getvalue() and "2.0/2.0 KiB" in buf.getvalue()
    buf.truncate(0)
    bar = common.progress_bar(2048, "verify")  # stderr is not a TTY here
    bar.update(2048)
    bar.close()
    assert buf.getvalue() == ""


def test_formatting_helpers():
    assert common.human_bytes(512) == "512 B" and common.human_bytes(1536) == "1.5 KiB"
    assert common.human_bytes(3 * 2**30) == "3.0 GiB"
    assert common.utc_time(0) == "-" and common.utc_time(86400.0) == "1970-01-02 00:00:00"
    assert common.jsonable({1: (1.5, float("nan")), "ns": __import__("argparse").Namespace(a=1)}) \
        == {"1": [1.5, "nan"], "ns": {"a": 1}}


def _script() -> list:
    exe = Path(sys.executable).with_name("xla-ckpt")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "xla_ckpt.cli.main"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_console_script_exit_codes(tmp_path):
    ck = str(tmp_path / "ck")
    xla_ckpt.save({"w": torch.arange(64, dtype=torch.float32)}, ck)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def run(*argv):
        return subprocess.run(_script() + list(argv), capture_output=True, text=True, env=env,
                              timeout=120)

    ok = run("verify", ck)
    assert ok.returncode == 0 and ok.stdout.startswith(f"OK {ck}: 1 tensors in 1 files")
    with open_storage(ck) as st:
        blob = read_manifest(st).item().blobs[0]
    flip_byte(ck, blob.file, blob.offset + 17)
    bad = run("verify", ck)
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[0].startswith(f"BAD state['w']: {blob.file}: crc32c of bytes")
    missing = run("verify", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr
