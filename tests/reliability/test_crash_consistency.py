"""SIGKILL the saving process at many points of its write sequence, locally and on the emulator.

The method (dry run -> kill points -> paused saver -> SIGKILL -> fresh
verifier) is described in ``crash_harness.py``.  After every kill:

* the previous checkpoint (``checkpoint_1_2``) is still committed and
  restores bitwise, and ``checkpoint_1_1`` survives unless the new save
  committed (rotation runs only after a commit);
* the new checkpoint is committed exactly when the kill came after its
  manifest landed; a torn one is never listed as committed by
  ``xla-ckpt ls`` and never chosen as "latest";
* a job resuming from the run folder gets the latest committed checkpoint
  bitwise, saves the next one, and restores that bitwise.

Fencing family (C15, ``crash_harness.fencing_campaign``): a successor incarnation starts
while the predecessor is paused at each point of its save (keep-last 1 on both); the
predecessor was SIGKILLed there (``kill``) or goes on once the successor saved (``resume``).
After every interleaving the successor's checkpoints survive byte for byte,
``checkpoint_last`` names its checkpoint and never went backwards, the predecessor's late
checkpoint is never pointed to, and the predecessor got ``FencedError`` naming both epochs
wherever a lease check was still ahead of it, then refused its next save without writing.

Sharded family (``crash_harness.sharded_campaign``): a 2-rank job saves DTensor state with
the chunked ``save_distributed`` (every rank writes its own chunk file, rank 0 commits the v2
manifest); one rank is SIGKILLed at each point of its own steps, then its peer.  After every
kill A and B stay committed and restore bitwise into DTensor targets on every rank, C is
committed exactly when rank 0 had published its manifest, "latest" and a resuming restore of
the run folder never pick the torn C (nor start from nothing), and the resumed job saves and
restores the next checkpoint bitwise.

CI runs bounded counts; ``benchmarks/reliability.py --crash-points N`` (``--parts sharded
--sharded-points N``) runs more.
"""

from __future__ import annotations

import re

import crash_harness as H
import pytest

from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CI_POINTS = 50
CI_ASYNC_POINTS = 12
CI_FENCING_POINTS = {("local", "resume"): 48, ("local", "kill"): 32, ("gcs", "resume"): 24,
                     ("gcs", "kill"): 16}


LANES = 2  # each campaign's points run in 2 lanes side by side (crash_harness.in_lanes)


@pytest.fixture(scope="module")
def zygote(gcs_emulator):
    """One clean worker process; every saver and verifier is forked from it."""
    pool = WorkerPool(1, xla=False, env=gcs_emulator.env())
    yield pool
    pool.close()


def _campaign(zygote, base_uri, backend, mode, count, **kw) -> dict:
    (res,) = zygote.run(H.campaign, base_uri, backend, mode, count, timeout_s=540,
                        lanes=LANES, **kw)
    return res.unwrap()


def _summary(out: dict, what: str) -> str:
    results = out["results"]
    committed = sum(r["expect_committed"] for r in results)
    strays = sum(bool(r["verify"].get("strays_after_kill")) for r in results)
    return (f"{what}: {len(results)} kill points over {len(out['steps'])} mutating steps "
            f"(commit marker at step {out['commit_step']}); {committed} after the commit, "
            f"{len(results) - committed} before; temp objects left by {strays} kills; "
            f"{out['seconds']:.1f} s")


def _assert_consistent(out: dict, count: int) -> None:
    results = out["results"]
    assert len(results) >= count
    violations = [v for r in results for v in H.check(r)]
    assert violations == []
    # The points cover both sides of the commit and every kind of place.
    assert 0 < sum(r["expect_committed"] for r in results) < len(results)
    kinds = {r["point"]["at"] for r in results}
    assert kinds == {"before", "byte", "after"}
    covered = {r["point"]["step"] for r in results}
    assert covered == set(range(len(out["steps"]))), "every step gets at least one kill point"


def test_local_sync_save_killed_at_50_points(zygote, tmp_path):
    out = _campaign(zygote, str(tmp_path / "crash"), "local", "sync", CI_POINTS)
    print(_summary(out, "local sync"))
    _assert_consistent(out, CI_POINTS)
    ops = {s["op"] for s in out["steps"]}
    # the commit marker is created only if absent (a hard link); the pointer is replaced
    assert ops == {"write", "fsync", "replace", "link", "unlink", "rmdir"}


def test_gcs_sync_save_killed_at_50_points(zygote, gcs_emulator):
    out = _campaign(zygote, gcs_emulator.unique_uri("crash"), "gcs", "sync", CI_POINTS,
                    emulator_host=gcs_emulator.host, bucket=gcs_emulator.bucket)
    print(_summary(out, "gcs sync"))
    _assert_consistent(out, CI_POINTS)
    # The one data file (state and rank item: a writer's items share one object) goes up as
    # 3 parts, composed, parts deleted; then the manifest, the pointer, and rotation's deletes
    # (the older checkpoint's data file and manifest).
    assert [s["op"] for s in out["steps"]] == (["upload"] * 3 + ["compose"] + ["delete"] * 3
                                               + ["upload"] * 2 + ["delete"] * 2)
    # Killed after a part landed and before the parts were deleted: those parts stay behind
    # as in-flight objects that no listing shows (and nothing else does).
    part = re.compile(r"^checkpoint_1_3/data-[0-9a-f]{12}-state\.safetensors\.tmp-[0-9a-f]{12}"
                      r"-part-0000[0-2]$")
    for r in out["results"]:
        strays = r["verify"]["strays_after_kill"]
        assert all(part.match(n) for n in strays), strays
        if strays:
            assert 1 <= r["point"]["step"] <= 6, r["label"]
    assert any(r["verify"]["strays_after_kill"] for r in out["results"])


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_async_save_killed_mid_upload(zygote, tmp_path, gcs_emulator, backend):
    base = str(tmp_path / "crash") if backend == "local" else gcs_emulator.unique_uri("crash-async")
    out = _campaign(zygote, base, backend, "async", CI_ASYNC_POINTS,
                    emulator_host=gcs_emulator.host, bucket=gcs_emulator.bucket)
    print(_summary(out, f"{backend} async"))
    results = out["results"]
    assert len(results) >= CI_ASYNC_POINTS
    assert [v for r in results for v in H.check(r)] == []
    assert 0 < sum(r["expect_committed"] for r in results) < len(results)


def _fencing(zygote, base_uri, backend, variant, **kw) -> dict:
    count = CI_FENCING_POINTS[(backend, variant)]
    (res,) = zygote.run(H.fencing_campaign, base_uri, backend, variant, count, timeout_s=540,
                        lanes=LANES, **kw)
    out = res.unwrap()
    results = out["results"]
    orders = sorted({r["order"] for r in results})
    print(f"{backend} fencing/{variant}: {len(results)} interleavings over {len(out['steps'])} "
          f"steps of the predecessor's save (manifest {out['manifest_step']}, pointer "
          f"{out['pointer_step']}, rotation {out['rotation_step']}); orders {orders}; "
          f"{out['seconds']:.1f} s")
    # (On the emulator a resumed predecessor pauses only between requests: see the harness.)
    assert len(results) >= (len(out["steps"]) if (backend, variant) == ("gcs", "resume")
                            else count)
    assert [v for r in results for v in H.check_fencing(r)] == []
    # The points cover every step, both sides of the commit marker and of every lease check.
    assert {r["point"]["step"] for r in results} == set(range(len(out["steps"])))
    assert 0 < sum(r["expect_committed"] for r in results) < len(results)
    assert 0 < sum(r["expect_fenced"] for r in results) < len(results)
    assert any(r["in_window"] and not r["expect_committed"] for r in results)
    return out


@pytest.mark.parametrize("variant", ["resume", "kill"])
def test_local_successor_fences_the_predecessor_at_every_point(zygote, tmp_path, variant):
    out = _fencing(zygote, str(tmp_path / "fence"), "local", variant)
    if variant == "resume":
        results = out["results"]
        # Left running, the predecessor was refused exactly where a lease check was ahead.
        fenced = [r for r in results if r["order"] == "S finished first"
                  and r["predecessor"]["saved_c"].get("error") == "FencedError"]
        assert {r["expect_fenced"] for r in fenced} == {True}
        # Paused inside a folder lock the successor needs, the successor waited for it.
        assert any(r["order"].startswith("S blocked") for r in results)


@pytest.mark.parametrize("variant", ["resume", "kill"])
def test_gcs_successor_fences_the_predecessor_at_every_point(zygote, gcs_emulator, variant):
    out = _fencing(zygote, gcs_emulator.unique_uri(f"fence-{variant}"), "gcs", variant,
                   emulator_host=gcs_emulator.host, bucket=gcs_emulator.bucket)
    # No folder locks on GCS: the successor always finished while the predecessor was paused.
    assert {r["order"] for r in out["results"]} <= {"S finished first", "S after P died"}


# ---- sharded family: SIGKILL one rank of a 2-rank sharded save_distributed (DTensor state) ----

CI_SHARDED_POINTS = {"local": 6, "gcs": 5}


def _sharded(zygote, base_uri, backend, **kw) -> dict:
    count = CI_SHARDED_POINTS[backend]
    (res,) = zygote.run(H.sharded_campaign, base_uri, backend, count, timeout_s=540,
                        lanes=LANES, **kw)
    out = res.unwrap()
    results = out["results"]
    print(f"{backend} sharded: {len(results)} kill points over the steps of "
          f"{ {v: len(s) for v, s in out['steps'].items()} } (rank 0's commit marker at step "
          f"{out['commit_step']}); {sum(r['expect_committed'] for r in results)} after the "
          f"commit; {out['seconds']:.1f} s")
    assert len(results) == count
    assert [v for r in results for v in H.check_sharded(r)] == []
    # Both ranks were killed, at points on both sides of rank 0's commit marker.
    assert {r["victim"] for r in results} == {0, 1}
    assert 0 < sum(r["expect_committed"] for r in results) < len(results)
    # Each rank wrote only its own chunk item's data file; rank 0 also the manifest.
    steps = out["steps"]
    writes = {v: [s["target"] for s in st if s["op"] in ("write", "upload")]
              for v, st in steps.items()}
    assert writes[1] and all("chunks-00001" in t for t in writes[1]), writes[1]
    assert all("chunks-00000" in t for t in writes[0][:-1]), writes[0]
    assert writes[0][-1].startswith(f"{H.C}/manifest.json")
    return out


def test_local_sharded_save_killed_on_either_rank(zygote, tmp_path):
    out = _sharded(zygote, str(tmp_path / "sharded"), "local")
    # the data files are published by rename, the manifest last (the commit marker)
    assert {s["op"] for s in out["steps"][1]} == {"write", "fsync", "replace"}


def test_gcs_sharded_save_killed_on_either_rank(zygote, gcs_emulator):
    out = _sharded(zygote, gcs_emulator.unique_uri("crash-sharded"), "gcs", recover=False,
                   emulator_host=gcs_emulator.host, bucket=gcs_emulator.bucket)
    # every rank's data file goes up as parts + compose (the traced knobs), the manifest after
    assert "compose" in {s["op"] for s in out["steps"][1]}
