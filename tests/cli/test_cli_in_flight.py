"""In-flight objects of interrupted uploads in ``xla-ckpt ls`` / ``gc`` / ``rm``, and what cleanup
never deletes.

A real process SIGKILLed while its multi-part save uploads leaves parts: ``ls`` lists them once
they are older than ``--grace`` (0 here), ``gc --in-flight --dry-run`` lists them and deletes
nothing, ``gc --in-flight`` deletes them and reports their exact bytes; with the default grace
period they are only counted, and ``rm`` of their folder says why it keeps them.  ``gc`` never
touches a ``.pt``, a DCP folder, a folder copied in from another run, an object outside the run
folder, or an in-flight object whose target is not one of this library's names.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import make_run

from xla_ckpt.storage import open_storage
from xla_ckpt.storage.gcs import TMP_MARK

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "storage", "interrupted_upload_worker.py")

SPECS = [("checkpoint_1_100", 100, 1, 2.5), ("checkpoint_2_200", 200, 2, 1.5),
         ("checkpoint_3_300", 300, 3, 1.75)]


def raw_objects(emu, prefix):
    """(name, size) of every object under ``prefix``, straight from the emulator's JSON API."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project=emu.project, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emu.host})
    try:
        return sorted((b.name, int(b.size)) for b in client.list_blobs(emu.bucket, prefix=prefix))
    finally:
        client.close()


def settled_parts(emu, prefix):
    """The in-flight objects under ``prefix`` once the listing stopped changing."""
    last, stable_since = None, time.monotonic()
    while True:
        now = [(n, s) for n, s in raw_objects(emu, prefix) if TMP_MARK in n]
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 0.5:
            return now
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_parts_of_a_killed_save_are_listed_by_ls_and_collected_by_gc(
        cli, gcs_uri, gcs_emulator, gcs_env, tmp_path):
    run = f"{gcs_uri}/run"
    prefix = run[len(f"gs://{gcs_emulator.bucket}/"):] + "/"
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, WORKER, "save", run], env=gcs_env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while len([n for n in gcs_emulator.object_names(prefix) if TMP_MARK in n]) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)   # no chance to clean up
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    parts = settled_parts(gcs_emulator, prefix)
    assert len(parts) >= 5 and all("/checkpoint_1_1/data-" in n and "-part-" in n
                                   for n, _ in parts)
    n_parts, n_bytes = len(parts), sum(s for _, s in parts)
    (target,) = {n[len(prefix):].split(TMP_MARK)[0] for n, _ in parts}
    (upload_id,) = {n.split(TMP_MARK)[1][:12] for n, _ in parts}
    exact = f"{n_bytes / 1024:.1f} KiB = {n_bytes} B" if n_bytes < 1 << 20 else \
        f"{n_bytes / (1 << 20):.1f} MiB = {n_bytes} B"

    # default grace period (1 h): counted only, never listed as left over
    r = cli("ls", run)
    assert r.code == 0 and r.err == ""
    assert r.out.splitlines() == [
        f"{run}: 0 committed, 0 incomplete",
        (f"in flight for less than 1.0 h (a save may still be writing them): {n_parts} objects, "
         f"{exact}")]

    r = cli("ls", run, "--grace", "0")
    assert r.code == 0
    lines = r.out.splitlines()
    assert lines[0] == f"{run}: 0 committed, 0 incomplete, {n_parts} in flight ({exact})"
    assert lines[1] == ("in flight (left by interrupted uploads, older than 0 s; "
                        "`xla-ckpt gc --in-flight` deletes them):")
    assert lines[2].startswith(f"  {target}: {n_parts} objects, {exact}, ")
    assert lines[2].endswith(f" s old (upload {upload_id})") and len(lines) == 3

    r = cli("ls", run, "--grace", "0s", "--json")
    doc = json.loads(r.out)
    assert doc["in_flight_grace_s"] == 0.0
    (up,) = doc["in_flight"]
    assert (up["target"], up["upload_id"], up["nbytes"], up["collectable"]) == (
        target, upload_id, n_bytes, True)
    assert sorted(f"{prefix}{o}" for o in up["objects"]) == [n for n, _ in parts]

    r = cli("gc", run, "--in-flight", "--grace", "0", "--dry-run")
    assert r.code == 0
    assert r.out.splitlines()[0].startswith(f"would delete in-flight {target}: {n_parts} objects")
    assert r.out.splitlines()[-1] == (f"would free {exact} (0 checkpoints, {n_parts} in-flight "
                                      "objects, dry run)")
    assert settled_parts(gcs_emulator, prefix) == parts   # nothing deleted

    r = cli("gc", run, "--in-flight")   # default grace: too young, kept
    assert r.code == 0
    assert r.out.splitlines() == [
        (f"kept {n_parts} in-flight object(s) ({exact}) younger than the grace period (1.0 h): "
         "a save may still be writing them"),
        "freed 0 B (0 checkpoints)"]
    r = cli("rm", run, "checkpoint_1_1")
    assert r.code == 1
    assert r.out.splitlines()[0] == (
        f"kept checkpoint_1_1: holds only {n_parts} in-flight object(s) younger than the grace "
        "period (3600 s): a save may still be writing them; `gc --in-flight` collects them once "
        "they are older")
    assert settled_parts(gcs_emulator, prefix) == parts

    r = cli("gc", run, "--incomplete", "--grace", "0")   # --incomplete implies --in-flight
    assert r.code == 0
    assert r.out.splitlines()[0].startswith(f"deleted in-flight {target}: {n_parts} objects")
    assert r.out.splitlines()[-1] == f"freed {exact} (0 checkpoints, {n_parts} in-flight objects)"
    assert raw_objects(gcs_emulator, prefix) == []
    r = cli("ls", run, "--grace", "0")
    assert r.out.splitlines() == [f"{run}: 0 committed, 0 incomplete"]


def test_rm_of_a_folder_holding_only_in_flight_parts_deletes_them_after_the_grace(
        cli, gcs_uri, gcs_emulator):
    run = f"{gcs_uri}/run"
    make_run(run, SPECS[:1])
    data = "checkpoint_2_200/data-0123456789ab-state.safetensors"
    with open_storage(run) as st:
        for i, n in enumerate((700, 300)):
            st.write_atomic(f"{data}{TMP_MARK}aaaaaaaaaaaa-part-{i:05d}", [b"p" * n])
        assert st.list("checkpoint_2_200") == []   # invisible to the ordinary listing
    r = cli("rm", run, "checkpoint_2_200", "--grace", "0", "--dry-run")
    assert r.code == 0
    assert r.out.splitlines()[0].startswith(f"would delete in-flight {data}: 2 objects, 1000 B, ")
    assert r.out.splitlines()[-1] == ("would free 1000 B (0 checkpoints, 2 in-flight objects, "
                                      "dry run)")
    r = cli("rm", run, "checkpoint_2_200", "--grace", "0")
    assert r.code == 0
    assert r.out.splitlines()[-1] == "freed 1000 B (0 checkpoints, 2 in-flight objects)"
    with open_storage(run) as st:
        assert st.list_in_flight() == []
        assert st.list("") != []   # checkpoint_1_100 is untouched
    r = cli("rm", run, "checkpoint_2_200", "--grace", "0")
    assert r.code == 1 and "no such checkpoint in this run folder" in r.out


def test_gc_deletes_only_what_this_library_wrote_in_the_run_folder(cli, root, request):
    make_run(root, SPECS, last="checkpoint_3_300", incomplete=["checkpoint_9_900"])
    is_gcs = root.startswith("gs://")
    ours_part = (f"checkpoint_9_900/data-0123456789ab-state.safetensors{TMP_MARK}"
                 "aaaaaaaaaaaa-part-00000")
    foreign = {
        "model.pt": b"a torch.save file copied in",
        "dcp_step_5/.metadata": b"dcp metadata",
        "dcp_step_5/__0_0.distcp": b"dcp shard",
        "lightning/epoch=3.ckpt": b"lightning",
        "other_run/checkpoint_3_300/manifest.json": b"{}",
        "other_run/checkpoint_3_300/data-0123456789ab-state.safetensors": b"nested data",
        "checkpoint_1_100/notes.txt": b"operator notes",   # inside a checkpoint gc rotates away
    }
    if is_gcs:   # in-flight marks that are not this library's writes into this run folder
        foreign[f"model.pt{TMP_MARK}bbbbbbbbbbbb-part-00000"] = b"not our target"
        foreign[f"other_run/checkpoint_3_300/data-0123456789ab-state.safetensors{TMP_MARK}"
                f"cccccccccccc-part-00000"] = b"nested part"
    outside = root.rstrip("/") + "-sibling"
    outside_objs = {"checkpoint_1_100/data-0123456789ab-state.safetensors": b"outside",
                    f"checkpoint_1_100/data-0123456789ab-state.safetensors{TMP_MARK}"
                    f"dddddddddddd-part-00000": b"outside part"}
    with open_storage(root) as st:
        for name, data in foreign.items():
            st.write_atomic(name, [data])
        if is_gcs:
            st.write_atomic(ours_part, [b"x" * 123])
    with open_storage(outside) as st:
        for name, data in outside_objs.items():
            st.write_atomic(name, [data])

        def cleanup():
            with open_storage(outside) as o:
                for name in outside_objs:
                    o.delete(name)

        request.addfinalizer(cleanup)

    r = cli("gc", root, "--keep-last", "1", "--incomplete", "--grace", "0")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert [ln for ln in lines if ln.startswith("deleted ")][:3] == [
        "deleted checkpoint_9_900", "deleted checkpoint_1_100", "deleted checkpoint_2_200"]
    assert ("kept dcp_step_5: dcp_step_5 is a PyTorch DCP checkpoint folder (.metadata), which "
            "xla_ckpt did not write; rm and gc delete only what xla_ckpt wrote. Left alone: "
            "remove it by hand if you mean to (xla_ckpt.load and `xla-ckpt convert` read it)"
            ) in lines
    assert ("kept lightning: holds 1 object(s) xla_ckpt did not write (e.g. epoch=3.ckpt); left "
            "alone, remove it by hand") in lines
    assert "left 1 object(s) xla_ckpt did not write in checkpoint_1_100 (e.g. notes.txt)" in lines
    in_flight = [ln for ln in lines if ln.startswith("deleted in-flight ")]
    if is_gcs:
        assert len(in_flight) == 1 and in_flight[0].startswith(
            "deleted in-flight checkpoint_9_900/data-0123456789ab-state.safetensors: 1 object, "
            "123 B, ")
        assert lines[-1].endswith("(3 checkpoints, 1 in-flight objects)")
    else:
        assert in_flight == [] and lines[-1].endswith("(3 checkpoints)")

    with open_storage(root) as st:
        for name, data in foreign.items():
            assert st.read_bytes(name) == data, name
        assert st.list_in_flight() == [o for o in st.list_in_flight()
                                       if not o.name.startswith("checkpoint_9_900/")]
        assert not any(n.startswith(("checkpoint_2_200/", "checkpoint_9_900/"))
                       for n in st.list(""))
        assert [n for n in st.list("checkpoint_1_100")] == ["checkpoint_1_100/notes.txt"]
        assert st.exists("checkpoint_3_300/manifest.json")
    with open_storage(outside) as st:
        for name, data in outside_objs.items():
            assert st.read_bytes(name) == data, name
