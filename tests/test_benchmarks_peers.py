"""benchmarks/gcs_restore.py: a missing or broken peer is one JSON line naming how to install it.

The peers themselves (Orbax, the GCS Connector for PyTorch) are too slow for tests and live in
virtualenvs of their own; here the discovery runs against a virtualenv path that does not exist,
a real virtualenv that lacks the peer's packages, and a gcsfs whose import fails. One smoke run
of the script (8 MiB, method a plus missing peers) checks the lines end to end.
"""

import importlib.util
import json
import os
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gcs_restore.py")


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("gcs_restore_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_benchmark()


def _broken_gcsfs(folder, error="ImportError('gcsfs is broken here')"):
    """A folder holding a ``gcsfs`` module whose import raises ``error`` (a broken install)."""
    folder.mkdir(exist_ok=True)
    (folder / "gcsfs.py").write_text(f"raise {error}\n")
    return str(folder)


def test_missing_peer_venvs_are_one_skip_line_each(bench, tmp_path):
    venvs = {"orbax": str(tmp_path / "no-orbax"), "dataflux": str(tmp_path / "no-dataflux")}
    runnable, skipped = bench.discover_methods("afghie", venvs)
    assert runnable == "ae"
    assert [s["method"] for s in skipped] == ["f", "g", "h", "i"]
    assert [s["skipped"] for s in skipped] == [
        "install with: bash scripts/setup_peers.sh orbax",
        "install with: bash scripts/setup_peers.sh orbax",
        "install with: bash scripts/setup_peers.sh dataflux",
        "install with: bash scripts/setup_peers.sh dataflux"]
    assert skipped[0]["reason"] == f"{tmp_path / 'no-orbax' / 'bin' / 'python'} not found"
    assert skipped[0]["name"] == "orbax(defaults)"
    assert all(set(s) == {"method", "name", "skipped", "reason"} for s in skipped)
    assert all("\n" not in json.dumps(s) for s in skipped)


def test_peer_venv_without_its_packages_is_skipped(bench, tmp_path):
    empty = tmp_path / "empty-venv"
    venv.create(empty, with_pip=False)  # a real interpreter that lacks orbax and dataflux
    runnable, skipped = bench.discover_methods("fh", {"orbax": str(empty), "dataflux": str(empty)})
    assert runnable == ""
    assert [(s["method"], s["skipped"]) for s in skipped] == [
        ("f", "install with: bash scripts/setup_peers.sh orbax"),
        ("h", "install with: bash scripts/setup_peers.sh dataflux")]
    python = str(empty / "bin" / "python")
    # Each reason is the probe's last stderr line, not a traceback.
    assert skipped[0]["reason"] == f"{python}: ModuleNotFoundError: No module named 'orbax'"
    assert skipped[1]["reason"] == f"{python}: ModuleNotFoundError: No module named 'torch'"


def test_gcsfs_absent_skips_d_naming_the_extra(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` raises ImportError
    runnable, skipped = bench.discover_methods("ad", {"orbax": "", "dataflux": ""})
    assert runnable == "a"
    assert skipped == [{"method": "d", "name": "dcp.FsspecReader(gcsfs)",
                        "skipped": "install with: .venv/bin/pip install -e '.[bench]'",
                        "reason": "gcsfs does not import: ModuleNotFoundError: "
                                  "import of gcsfs halted; None in sys.modules"}]


def test_gcsfs_that_fails_on_import_skips_d(bench, tmp_path, monkeypatch):
    # A broken install raises whatever its own imports raise, not only ImportError.
    monkeypatch.delitem(sys.modules, "gcsfs", raising=False)
    monkeypatch.syspath_prepend(_broken_gcsfs(tmp_path / "site", "RuntimeError('aiohttp ABI')"))
    runnable, skipped = bench.discover_methods("da", {"orbax": "", "dataflux": ""})
    monkeypatch.delitem(sys.modules, "gcsfs", raising=False)
    assert runnable == "a"
    assert skipped[0]["method"] == "d"
    assert skipped[0]["skipped"] == "install with: .venv/bin/pip install -e '.[bench]'"
    assert skipped[0]["reason"] == "gcsfs does not import: RuntimeError: aiohttp ABI"


def test_summary_takes_each_targets_fastest_peer(bench):
    results = {"a": {"seconds": 1.0}, "f": {"seconds": 5.5}, "g": {"seconds": 2.5},
               "i": {"seconds": 9.0}}
    assert bench.summary(results) == {
        "summary": "a vs peers (median seconds of peer / of a)",
        "a_vs_orbax_best": {"peer": "g", "ratio": 2.5, "target": 3.0, "met": False},
        "a_vs_orbax_defaults": {"peer": "f", "ratio": 5.5, "target": 5.0, "met": True},
        "a_vs_gcs_connector": {"peer": "i", "ratio": 9.0, "target": 5.0, "met": True}}
    assert bench.summary({"f": {"seconds": 1.0}}) is None


@pytest.mark.slow
def test_script_runs_the_rest_when_peers_are_missing(tmp_path):
    env = {**os.environ, "GCS_RESTORE_ORBAX_VENV": str(tmp_path / "nowhere"),
           "GCS_RESTORE_DATAFLUX_VENV": str(tmp_path / "nowhere"),
           "PYTHONPATH": _broken_gcsfs(tmp_path / "site")}
    out = subprocess.run([sys.executable, SCRIPT, "--size-mib", "8", "--repeat", "1",
                          "--methods", "a,d,f,h"], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(x["method"], x["skipped"]) for x in lines[:3]] == [
        ("d", "install with: .venv/bin/pip install -e '.[bench]'"),
        ("f", "install with: bash scripts/setup_peers.sh orbax"),
        ("h", "install with: bash scripts/setup_peers.sh dataflux")]
    assert lines[0]["reason"] == "gcsfs does not import: ImportError: gcsfs is broken here"
    a = lines[3]
    assert (a["method"], a["bitwise_ok"], a["size_mib"], a["runs_seconds"] != []) == \
        ("a", True, 8, True)
    assert a["mib_served"] >= 8.0
    assert lines[4] == {"summary": "a vs peers (median seconds of peer / of a)"}
    assert len(lines) == 5
