"""benchmarks/sharded_restore.py in small (``--quick``): every line it prints, no timings.

Real parts: 2 gloo ranks with FSDP2 state, xla_ckpt's and DCP's own saves and restores on local
disk, the replicated save both ways, the chunked manifest parse.  gcsfs is made to fail on
import, so the DCP-over-GCS method is one skip line naming the ``bench`` extra.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "sharded_restore.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_prints_every_line_with_checked_figures(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "gcsfs.py").write_text("raise ImportError('gcsfs is broken here')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, SCRIPT, "--quick", "--ranks", "2",
                          "--methods", "xla_ckpt_local,dcp_local,dcp_gcs"],
                         env=env, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0] == {"method": "dcp_gcs", "extra": "bench",
                        "skipped": "install with: .venv/bin/pip install -e '.[bench]'",
                        "reason": "gcsfs does not import: ImportError: gcsfs is broken here"}
    manifest = lines[1]
    assert (manifest["part"], manifest["tensors"], manifest["chunks_per_tensor"],
            manifest["tensor_records"]) == ("manifest", 50, 16, 800)
    assert manifest["bytes"] > 800 * 100 and len(manifest["parse_runs_seconds"]) == 3
    by = {x["method"]: x for x in lines[2:-1]}
    assert list(by) == ["xla_ckpt_local", "dcp_local", "save_balanced", "save_rank0"]
    ours, dcp = by["xla_ckpt_local"], by["dcp_local"]
    for line in (ours, dcp):
        assert line["bitwise_ok"] is True and line["ranks"] == 2
        assert len(line["shard_mib_per_rank"]) == 2 and min(line["shard_mib_per_rank"]) > 3
    # Each rank reads its own shards only (8 MiB of state over 2 ranks), nothing twice.
    assert all(r <= 1.05 for r in ours["read_over_shard_per_rank"])
    assert ours["stats_read_received_mapped_mib_rank0"][1:] == [0.0, 0.0]
    assert ours["ratio_vs_dcp_local"] > 0 and dcp["ratio_vs_xla_ckpt_local"] > 0
    # Balanced: both ranks write about half the replicated state; the old path: rank 0 all of it.
    bal, old = by["save_balanced"], by["save_rank0"]
    assert bal["bitwise_ok"] is True and old["bitwise_ok"] is True
    assert all(3.5 <= w <= 4.6 for w in bal["mib_written_per_rank"]), bal
    assert old["mib_written_per_rank"][0] >= 8.0 and old["mib_written_per_rank"][1] < 0.5, old
    summary = lines[-1]
    assert summary["summary"] == "targets (issue 12)"
    assert set(summary) == {"summary", "restore_vs_dcp_local_disk",
                            "xla_ckpt_local_bytes_read_over_shard_max",
                            "xla_ckpt_local_peak_rss_over_shard_max",
                            "save_balanced_vs_rank0_8mib_replicated", "manifest_parse_seconds"}
    assert summary["xla_ckpt_local_bytes_read_over_shard_max"]["met"] is True
