"""benchmarks/tensor_count.py in small (``--quick``): every line it prints, no timings.

Real parts: xla_ckpt's, the trainer's, torch's and DCP's own saves and restores of an AdamW
state of many tiny parameters on local disk; each restore is checked bitwise by the script.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tensor_count.py")
METHODS = ["xla_save", "xla_load", "trainer_save", "trainer_restore", "torch_save",
           "torch_load", "dcp_save", "dcp_load"]


@pytest.mark.timeout(120)
def test_quick_run_prints_every_method_and_size_then_the_summary(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, SCRIPT, "--quick", "--sizes", "8,32", "--at", "32",
                          "--growth-from", "8", "--clock", "cpu"],
                         env=env, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    body, summary = lines[:-1], lines[-1]
    assert [(x["method"], x["tensors"], x["params"]) for x in body] == \
        [(m, t, t // 4) for t in (8, 32) for m in METHODS]
    for x in body:
        assert x["seconds"] > 0 and x["cpu_seconds"] > 0 and len(x["runs"]) == 1
        if x["method"] in ("xla_load", "trainer_restore", "torch_load", "dcp_load"):
            assert x["bitwise_ok"] is True, x
    by = {(x["method"], x["tensors"]): x for x in body}
    assert set(by["xla_load", 32]) >= {"ratio_vs_torch_load", "ratio_vs_dcp_load"}
    assert set(by["trainer_save", 32]) >= {"ratio_vs_torch_save", "ratio_vs_dcp_save"}
    assert summary["summary"] == "targets (issue 25)"
    assert (summary["at_tensors"], summary["growth_from_tensors"]) == (32, 8)
    assert summary["clock"] == "cpu"
    for m in ("xla_load", "trainer_restore"):
        target = summary[f"{m}_vs_torch_load_at_32"]
        assert set(target) == {"ratio", "target", "met"} and target["target"] == 1.0
        assert target["met"] is (target["ratio"] >= 1.0)
    for m in ("xla_save", "xla_load", "trainer_save", "trainer_restore"):
        growth = summary[f"{m}_growth_8_to_32"]
        assert (growth["tensor_ratio"], growth["target"]) == (4.0, 4.8)
        assert growth["met"] is (growth["ratio"] <= 4.8)
    assert set(summary["xla_save_vs_torch_save_at_32"]) == {"ratio", "target"}
    assert os.listdir(tmp_path) == []  # every size's folder removed


def test_sizes_that_are_not_whole_parameters_are_refused():
    out = subprocess.run([sys.executable, SCRIPT, "--sizes", "10"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "--sizes: every size is a multiple of 4 tensors" in out.stderr
