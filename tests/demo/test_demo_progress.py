"""``xla-ckpt demo``'s output: progress lines while it runs, one prefix, one verdict line last.

The whole demo runs in ``test_demo.py``; these tests check the pieces with their real inputs:
the heartbeat against a clock the test moves, the helper thread of a blocking step, the verdict
of a report, and the CLI's last line for a report and for a leg that failed.
"""

import json
import logging
import threading

import pytest

from xla_ckpt.cli.main import main
from xla_ckpt.demo import report as demo_report
from xla_ckpt.demo import run as demo_run
from xla_ckpt.demo.phase import DemoError
from xla_ckpt.demo.progress import Heartbeat, step
from xla_ckpt.demo.report import failure_line, verdict_line


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_says_started_still_running_every_interval_and_done(caplog):
    caplog.set_level(logging.INFO, logger="xla_ckpt.demo")
    clock = _Clock()
    hb = Heartbeat("phase resume-all_ranks", every_s=15.0, clock=clock)
    hb.start("4 workers")
    beats = []
    for t in (5.0, 14.9, 15.0, 20.0, 29.9, 30.0, 61.0):
        clock.now = 100.0 + t
        beats.append(hb.beat(f"rank 0 at update {int(t)}"))
    clock.now = 100.0 + 75.25
    assert hb.done() == 75.25
    assert beats == [False, False, True, False, False, True, True]
    assert [r.getMessage() for r in caplog.records] == [
        "phase resume-all_ranks: started (4 workers)",
        "phase resume-all_ranks: still running, 15 s (rank 0 at update 15)",
        "phase resume-all_ranks: still running, 30 s (rank 0 at update 30)",
        "phase resume-all_ranks: still running, 61 s (rank 0 at update 61)",
        "phase resume-all_ranks: done in 75.2 s"]


def test_a_blocking_step_beats_from_its_own_thread(caplog):
    caplog.set_level(logging.INFO, logger="xla_ckpt.demo")
    seen = threading.Event()

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "still running" in record.getMessage():
                seen.set()

    spy = Spy()
    logging.getLogger("xla_ckpt.demo").addHandler(spy)
    try:
        with step("fsdp: reading the saved global tensors", every_s=0.01):
            assert seen.wait(timeout=30.0)  # the step blocks; its thread still reports
    finally:
        logging.getLogger("xla_ckpt.demo").removeHandler(spy)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "fsdp: reading the saved global tensors: started"
    assert messages[1].startswith("fsdp: reading the saved global tensors: still running, ")
    assert messages[-1].startswith("fsdp: reading the saved global tensors: done in ")
    assert not any(t.name.startswith("heartbeat ") for t in threading.enumerate())


ALL_OK = {"all_ranks": True, "broadcast": True, "per_host": True, "striped": True,
          "auto": True, "fsdp_same_size": True, "fsdp_resharded": True}


def test_verdict_line_passes_only_when_every_restore_is_bitwise_identical():
    assert verdict_line({"bitwise_identical": ALL_OK}, 312.4) == (
        "PASS: every restore bitwise identical: ddp (all_ranks, broadcast, per_host, striped, "
        "auto), fsdp (same_size, resharded); 7 restores in 312 s")
    bad = dict(ALL_OK, striped=False, fsdp_resharded=False)
    assert verdict_line({"bitwise_identical": bad}, 60.0) == (
        "FAIL: not bitwise identical: ddp (striped), fsdp (resharded); 5 of 7 restores passed "
        "in 60 s")
    only_fsdp = {"fsdp_same_size": False, "fsdp_resharded": True}
    assert verdict_line({"bitwise_identical": only_fsdp}, 9.6) == (
        "FAIL: not bitwise identical: fsdp (same_size); 1 of 2 restores passed in 10 s")
    assert verdict_line({"bitwise_identical": {}, "legs": ["ddp"]}, 1.0) == (
        "FAIL: no restore was checked (legs ddp) in 1 s")
    local = dict(ALL_OK, local_crash=True, local_flipped=False)
    assert verdict_line({"bitwise_identical": local}, 5.0) == (
        "FAIL: not bitwise identical: local (flipped); 8 of 9 restores passed in 5 s")


def test_failure_line_names_the_leg_that_did_not_finish():
    e = DemoError("fsdp-train: rank 1 exited with 1 (RuntimeError: boom); exit codes [0, 1]\n"
                  "more", leg="fsdp")
    assert failure_line(e, 42.0) == ("FAIL: leg fsdp did not finish: fsdp-train: rank 1 exited "
                                     "with 1 (RuntimeError: boom); exit codes [0, 1] "
                                     "(after 42 s)")
    assert failure_line(ValueError("bad"), 0.4) == "FAIL: the demo did not finish: bad (after 0 s)"


def test_leg_names_itself_in_a_phase_error():
    with pytest.raises(DemoError) as e:
        with demo_run._leg("ddp"):
            raise DemoError("train: rank 0 exited with 1")
    assert e.value.leg == "ddp"


def _report(ok: dict) -> dict:
    return {"workers": 2, "hosts": 1, "model": "tiny", "updates": 8, "storage": "local path",
            "legs": ["fsdp"], "restores": [], "bitwise_identical": ok}


@pytest.mark.parametrize("json_out", [False, True])
def test_cli_prints_one_verdict_line_last_and_exits_nonzero_on_fail(capsys, monkeypatch,
                                                                    json_out):
    monkeypatch.setattr(demo_report, "format_table", lambda report: "TABLE")
    outcomes = [
        (_report({"fsdp_same_size": True, "fsdp_resharded": True}), 0,
         "PASS: every restore bitwise identical: fsdp (same_size, resharded); 2 restores in "),
        (_report({"fsdp_same_size": True, "fsdp_resharded": False}), 1,
         "FAIL: not bitwise identical: fsdp (resharded); 1 of 2 restores passed in "),
        (DemoError("fsdp-reshard: rank 0 exited with 1 (OSError: disk full)", "\nrank 0 tail",
                   leg="fsdp"), 1,
         ("FAIL: leg fsdp did not finish: fsdp-reshard: rank 0 exited with 1 (OSError: disk "
          "full) (after ")),
    ]
    for outcome, code, verdict in outcomes:
        def fake_run_demo(outcome=outcome, **kw):
            demo_run.logger.info("leg fsdp: started")
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        monkeypatch.setattr(demo_run, "run_demo", fake_run_demo)
        argv = ["demo", "--legs", "fsdp", "--model", "tiny"] + (["--json"] if json_out else [])
        assert main(argv) == code
        got = capsys.readouterr()
        out, err = got.out.splitlines(), got.err.splitlines()
        assert "xla-ckpt demo: demo:" not in got.err
        assert any(ln.startswith("xla-ckpt demo: [") and ln.endswith("] leg fsdp: started")
                   for ln in err)
        if json_out:
            assert len(out) == 1
            doc = json.loads(out[0])
            assert doc["verdict"].startswith(verdict)
            assert [ln for ln in err if ln.startswith(("PASS", "FAIL"))] == [doc["verdict"]]
        else:
            assert out[-1].startswith(verdict)
            assert [ln for ln in out if ln.startswith(("PASS", "FAIL"))] == [out[-1]]
            if code == 0 or "not bitwise" in verdict:
                assert out[:-1] == ["TABLE"]
        if isinstance(outcome, DemoError):
            assert "rank 0 tail" in err
            assert "xla-ckpt demo: error: fsdp-reshard: rank 0 exited with 1" in got.err
