"""benchmarks/peer_restore.py in small (8 MiB, one run): every line it prints, no timings.

Real parts: 2 gloo workers on 2 emulated hosts, managers with a local tier on /dev/shm and
replicas, the shaped GCS emulator as the durable tier, a replaced host healed from its peer,
torchft's HTTPTransport when the ``bench`` extra is installed (else its line says how to
install it), the gloo data plane.  A second run hides torchft: its line names the extra.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "peer_restore.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _run(env: dict | None = None) -> list[dict]:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("xla_ckpt_peer_")}
    out = subprocess.run([sys.executable, SCRIPT, "--size-mib", "8", "--repeat", "1"],
                         capture_output=True, text=True, timeout=220, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    after = {n for n in os.listdir("/dev/shm") if n.startswith("xla_ckpt_peer_")}
    assert after <= before  # the local tiers were removed
    # The JSON lines; gloo's workers print their "[Gloo] Rank ... connected" lines there too.
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _check(lines: list[dict], torchft: bool) -> None:
    by = {ln["method"]: ln for ln in lines}
    assert list(by)[-1] == "summary"
    rep = by["replaced_host_restore"]
    assert rep["bitwise_ok"] and rep["tier"] == ["local"]
    assert rep["durable_mib_per_host"] == [0.0, 0.0]  # nothing from GCS
    assert rep["peer_mib_per_host"][0] == 0.0 and rep["peer_mib_per_host"][1] >= 8.0
    assert rep["transfer_s"] > 0 and rep["seconds"] > 0
    gcs = by["gcs_restore"]
    assert gcs["bitwise_ok"] and sum(gcs["durable_mib_per_host"]) >= 8.0
    assert by["data_plane"]["bitwise_ok"]
    s = by["summary"]
    assert s["bitwise_ok"] and [h["host"] for h in s["host_memory"]] == [0, 1]
    t = s["targets"]
    assert set(t) == {"replaced_vs_gcs_restore", "replaced_vs_torchft_http",
                      "transfer_vs_data_plane"}
    assert t["replaced_vs_gcs_restore"]["zero_gcs_bytes"] is True
    for name in ("replaced_vs_gcs_restore", "transfer_vs_data_plane"):
        assert t[name]["ratio"] > 0 and isinstance(t[name]["met"], bool)
    if torchft:
        assert by["torchft_http"]["bitwise_ok"] and t["replaced_vs_torchft_http"]["ratio"] > 0
    else:
        want = "install with: pip install -e '.[bench]'  (torchft==0.2.0)"
        assert by["torchft_http"]["skipped"] == want
        assert t["replaced_vs_torchft_http"]["ratio"] is None
        assert t["replaced_vs_torchft_http"]["met"] is False


def test_small_run_prints_every_method_then_the_summary():
    try:
        import torchft  # noqa: F401 - whether the bench extra is here
        have = True
    except ImportError:
        have = False
    _check(_run(), have)


def test_without_torchft_its_line_says_which_extra_to_install(tmp_path):
    (tmp_path / "torchft").mkdir()
    (tmp_path / "torchft" / "__init__.py").write_text("raise ImportError('no torchft here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    _check(_run(env), False)
