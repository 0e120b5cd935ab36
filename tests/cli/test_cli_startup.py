"""``xla-ckpt`` start-up and pipes: ``--help`` imports no torch; a closed stdout ends quietly.

The pipe tests run the real console script with its stdout a real pipe whose reader has already
gone (what ``xla-ckpt inspect RUN | head -1`` becomes once ``head`` exits): exit 141
(128 + SIGPIPE, as a shell reports for ``cat``), nothing on stderr.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli import main as main_mod
from xla_ckpt.cli.common import EXIT_BROKEN_PIPE
from xla_ckpt.cli.main import COMMANDS, build_parser, main

_MODULES_AFTER = """
import sys
from xla_ckpt.cli.main import main
code = main(sys.argv[1:])
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("CODE", code, "TORCH", torch[:3], file=sys.stderr)
"""


def _modules_after(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _MODULES_AFTER, *argv], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_do_not_import_torch(argv):
    proc = _modules_after(*argv)
    last = proc.stderr.strip().splitlines()[-1]
    code = 2 if argv == [] else 0
    assert last == f"CODE {code} TORCH []", proc.stderr[-2000:]
    if argv == ["--help"]:
        for name in COMMANDS:  # every command is listed with its summary
            assert name in proc.stdout


def test_ls_inspect_verify_rm_gc_run_without_torch(tmp_path):
    """The commands that read only manifests and bytes never import torch (start-up ~0.3 s
    instead of ~2 s); values are checked by the commands' own tests."""
    run = tmp_path / "run"
    for n in (10, 20, 30):
        xla_ckpt.save({"model": {"w": torch.ones(3) * n}, "args": argparse.Namespace(lr=0.1),
                       "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}},
                      str(run / f"checkpoint_1_{n}"),
                      metadata={"num_updates": n, "epoch": 1, "loss": 1.5})
    for argv in (["ls", str(run)], ["ls", str(run), "--json"], ["inspect", str(run)],
                 ["inspect", str(run / "checkpoint_1_20"), "--json"], ["inspect", "--help"],
                 ["ls", "--help"], ["verify", str(run)],
                 ["verify", str(run / "checkpoint_1_20"), "--json"],
                 ["rm", str(run), "checkpoint_1_10"], ["gc", str(run), "--keep-last", "1"]):
        proc = _modules_after(*argv)
        assert proc.stderr.strip().splitlines()[-1] == "CODE 0 TORCH []", (argv, proc.stderr)
    assert sorted(os.listdir(run)) == ["checkpoint_1_30"]


def test_import_xla_ckpt_is_lazy_and_load_save_still_work(tmp_path):
    code = ("import sys, xla_ckpt; assert 'torch' not in sys.modules; "
            "assert {'load', 'save'} <= set(dir(xla_ckpt)); "
            "from xla_ckpt import save; import torch; "
            f"save({{'w': torch.arange(3)}}, {str(tmp_path / 'ck')!r}); "
            f"print(xla_ckpt.load({str(tmp_path / 'ck')!r})['w'].tolist())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "[0, 1, 2]\n"
    with pytest.raises(AttributeError, match="has no attribute 'lod'"):
        xla_ckpt.lod  # noqa: B018 - the attribute access is the test


def test_every_summary_is_the_commands_own_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert isinstance(sub, argparse._SubParsersAction)
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert helps == COMMANDS
    lazy = next(a for a in build_parser(["ls"])._actions if a.dest == "command")
    assert isinstance(lazy, argparse._SubParsersAction)
    assert list(lazy.choices) == list(COMMANDS)


class _ClosedPipe:
    """A stdout whose reader is gone: every write raises as a real closed pipe does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_closed_stdout_in_process_is_quiet_141(tmp_path, monkeypatch, capsys):
    xla_ckpt.save({"w": torch.ones(2)}, str(tmp_path / "run" / "checkpoint_1_2"))
    for argv in (["ls", str(tmp_path / "run")], ["inspect", str(tmp_path / "run")],
                 ["inspect", str(tmp_path / "run"), "--json"], ["--help"]):
        monkeypatch.setattr(sys, "stdout", _ClosedPipe())
        assert main(["--no-progress", *argv]) == EXIT_BROKEN_PIPE == 141, argv
        monkeypatch.undo()
        assert capsys.readouterr().err == "", argv
    assert main_mod.EXIT_BROKEN_PIPE == 141


def _script() -> list:
    exe = Path(sys.executable).with_name("xla-ckpt")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "xla_ckpt.cli.main"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_closed_pipe_for_inspect_ls_verify_is_quiet_141(tmp_path):
    run = tmp_path / "run"
    xla_ckpt.save({f"layer{i}": torch.full((4,), float(i)) for i in range(300)},
                  str(run / "checkpoint_1_10"), metadata={"num_updates": 10, "epoch": 1})
    xla_ckpt.save({"w": torch.ones(2)}, str(run / "checkpoint_1_20"),
                  metadata={"num_updates": 20, "epoch": 1})
    for argv in (["inspect", str(run)], ["ls", str(run)], ["verify", str(run)],
                 ["inspect", str(run), "--json"], ["--help"]):
        r, w = os.pipe()
        os.close(r)  # the reader (``head -1``) has gone before the command writes
        try:
            proc = subprocess.run(_script() + argv, stdout=w, stderr=subprocess.PIPE, text=True,
                                  timeout=120)
        finally:
            os.close(w)
        # argparse prints --help itself and ignores a closed stdout: 0, quietly too.
        expected = 0 if argv == ["--help"] else 141
        assert (proc.returncode, proc.stderr) == (expected, ""), (argv, proc.stderr[-2000:])
    # A reader that takes the first line and leaves: the line it got is the real one.
    proc = subprocess.run(f"{' '.join(_script())} inspect {run} | head -1; "
                          "echo status=${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, timeout=120)
    first, status = proc.stdout.splitlines()
    assert first.split() == ["checkpoint", str(run / "checkpoint_1_20"), "(latest", "in",
                             f"{run})"]
    assert status in ("status=0", "status=141") and proc.stderr == ""
