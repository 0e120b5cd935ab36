"""Progress bars (xla_ckpt.cli.common.progress_bar): drawn only on a terminal, in MiB, and
drawn even when the terminal reports no size (a fresh pty, some CI runners, `stty cols 0`),
where plain tqdm draws nothing at all."""

import fcntl
import io
import os
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.common import DEFAULT_TERMINAL_SIZE, progress_bar, terminal_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 2**20


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@pytest.fixture
def pty_pair():
    """A pseudo-terminal that reports 0 rows and 0 columns (as `stty rows 0 cols 0`)."""
    master, slave = os.openpty()
    set_winsize(slave, 0, 0)
    assert tuple(os.get_terminal_size(slave)) == (0, 0)
    yield master, slave
    for fd in (master, slave):
        try:
            os.close(fd)
        except OSError:
            pass


def drain(master: int) -> str:
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other side closed (Linux answers EIO)
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace")


def frames(text: str) -> list[str]:
    """What the bar drew, one redraw each (tqdm redraws a line after a carriage return)."""
    return [f.rstrip() for f in text.replace("\r\n", "\r").split("\r") if f.strip()]


def test_a_terminal_that_reports_no_size_still_gets_a_bar_in_mib(pty_pair, monkeypatch):
    master, slave = pty_pair
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    with os.fdopen(os.dup(slave), "w", encoding="utf-8") as tty:
        assert terminal_size(tty) == DEFAULT_TERMINAL_SIZE
        bar = progress_bar(4 * MiB, "verify", file=tty)  # enabled=None: it is a terminal
        for _ in range(4):
            bar.update(MiB)
            bar.refresh()  # a tqdm bar here: draw each step now
        bar.close()
    drawn = frames(drain(master))
    assert drawn[0].startswith("verify:   0%|") and drawn[0].endswith("0.0/4.0 MiB [00:00<?, "
                                                                     "? MiB/s]")
    assert [f.split("|")[0] for f in drawn[:5]] == ["verify:   0%", "verify:  25%",
                                                    "verify:  50%", "verify:  75%",
                                                    "verify: 100%"]
    assert " 4.0/4.0 MiB " in drawn[4] and "█" * 20 in drawn[4]
    assert all(len(f) <= DEFAULT_TERMINAL_SIZE[0] - 1 for f in drawn)


def test_columns_from_the_environment_win(pty_pair, monkeypatch):
    master, slave = pty_pair
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("LINES", "10")
    with os.fdopen(os.dup(slave), "w", encoding="utf-8") as tty:
        assert terminal_size(tty) == (60, 10)
        bar = progress_bar(None, "read", file=tty)  # unknown total: a running count
        bar.update(3 * MiB // 2)
        bar.refresh()  # a tqdm bar here
        bar.close()
    drawn = frames(drain(master))
    assert drawn[-1].startswith("read: 1.5 MiB [00:00, ")
    assert all(len(f) <= 59 for f in drawn)


def test_a_sized_terminal_is_used_as_it_reports(pty_pair, monkeypatch):
    master, slave = pty_pair
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    set_winsize(slave, 30, 100)
    with os.fdopen(os.dup(slave), "w", encoding="utf-8") as tty:
        assert terminal_size(tty) == (100, 30)
        bar = progress_bar(MiB, "x", file=tty)
        bar.update(MiB)
        bar.refresh()  # a tqdm bar here
        bar.close()
    assert max(len(f) for f in frames(drain(master))) == 99  # the whole width but one column


def test_not_a_terminal_draws_nothing_unless_forced():
    buf = io.StringIO()
    bar = progress_bar(MiB, "verify", file=buf)
    bar.update(MiB)
    bar.close()
    assert buf.getvalue() == ""
    forced = progress_bar(2 * MiB, "verify", enabled=True, file=buf)
    forced.update(MiB)
    forced.close()
    assert "verify:   0%|" in buf.getvalue() and "/2.0 MiB" in buf.getvalue()
    off = io.StringIO()
    progress_bar(MiB, "verify", enabled=False, file=off).update(MiB)
    assert off.getvalue() == ""
    small = io.StringIO()  # under 1 MiB of work: KiB, not "0.0/0.0 MiB"
    bar = progress_bar(2048, "verify", enabled=True, file=small)
    bar.update(2048)
    bar.refresh()  # a tqdm bar here
    bar.close()
    assert "| 2.0/2.0 KiB [" in small.getvalue()


def test_xla_ckpt_verify_draws_on_a_stderr_pty_without_a_size(pty_pair, tmp_path):
    master, slave = pty_pair
    ckpt = str(tmp_path / "checkpoint_1_1")
    xla_ckpt.save({"w": torch.zeros(MiB // 4)}, ckpt)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(TERM="xterm", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "xla_ckpt.cli.main", "verify", ckpt],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                          env=env, cwd=REPO, timeout=120, check=False)
    drawn = frames(drain(master))
    assert proc.returncode == 0, proc.stdout
    assert drawn and drawn[0].startswith("verify:   0%|")
    assert "/1.0 MiB [" in drawn[0]
    assert all(len(f) <= DEFAULT_TERMINAL_SIZE[0] - 1 for f in drawn)
