"""The demo's report: each restore judged, the tables ``xla-ckpt demo`` prints, the last line.

A restore of the replicated leg that trains on is judged by :func:`resume_verdict` (losses and
final parameters against the uninterrupted reference), one that only restores by
:func:`restore_verdict`, and every row against the ``all_ranks`` resume's restored state by
:func:`check_states`; a restore of the sharded leg by :func:`sharded_verdict` (local shards
against the saved global tensors and DCP's restore), its restore from the tiers also by
:func:`tier_resharded_verdict` (tier, bytes by tier per host, nothing from GCS).
:func:`format_table` renders the report that :func:`xla_ckpt.demo.run.run_demo` returns;
:func:`verdict_line` and :func:`failure_line` give the one PASS/FAIL line the CLI ends with.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from xla_ckpt.demo.phase import DemoError, PhaseResult


def global_losses(reports: list[dict]) -> dict[int, str]:
    """Per-update global losses; every rank must report the same value."""
    merged: dict[int, str] = {}
    for r in reports:
        for u, v in r["losses"].items():
            u = int(u)
            if merged.setdefault(u, v) != v:
                raise DemoError(f"ranks disagree on the loss of update {u}")
    return merged



def shard_mismatches(global_tensors: dict[str, Any], tables: list[dict]) -> list[str]:
    """``"rank r: key"`` for every local shard (of :func:`xla_ckpt.demo.fsdp.shard_table`)
    whose crc32c differs from its box of the global tensor (or whose key is missing)."""
    from xla_ckpt.format.crc import crc32c  # noqa: PLC0415 - light
    from xla_ckpt.testing.asserts import tensor_bits  # noqa: PLC0415 - light

    bad = []
    for rank, table in enumerate(tables):
        for key, e in table.items():
            full = global_tensors.get(key)
            if full is None:
                bad.append(f"rank {rank}: {key} (not in the checkpoint)")
                continue
            box = full[tuple(slice(o, o + s) for o, s in
                             zip(e["offsets"], e["sizes"], strict=True))]
            crc = crc32c(tensor_bits(box.contiguous())) if box.numel() else 0
            if list(box.shape) != e["sizes"] or crc != e["crc32c"]:
                bad.append(f"rank {rank}: {key}")
    return bad


def sharded_verdict(kind: str, reports: list[dict], global_tensors: dict[str, Any],
                    saved_bad: list[str], *, ref: list[dict] | None, pre: list[dict]) -> dict:
    """One restore of the sharded leg, judged.

    ``shards_equal_saved``: every rank's restored local shards equal their boxes of the saved
    global tensors (and those equal the shards every rank saved: ``saved_bad`` is empty);
    ``shards_equal_dcp``: the same boxes and bytes as DCP's restore of the same state; for
    ``same_size`` (``ref`` given) also ``losses_identical`` (the preempted run's losses up to
    the checkpoint plus the resumed run's equal the reference's) and ``shards_identical`` (each
    rank's final local shards equal the reference rank's).
    """
    restores = [r["restore"] for r in reports]
    mismatched = shard_mismatches(global_tensors, [r["shards"] for r in restores]) + saved_bad
    dcp_equal = all(r.get("dcp_shards") == r["shards"] for r in restores)
    out: dict[str, Any] = {
        "restore": kind, "workers": len(reports),
        "saved_workers": restores[0]["saved_world_size"], "strategy": restores[0]["strategy"],
        "resumed_at_update": restores[0]["num_updates"],
        "bytes_read_per_rank": [r["bytes_read"] for r in restores],
        "shard_bytes_per_rank": [r["shard_bytes"] for r in restores],
        "seconds": round(max(r["seconds"] for r in restores), 3),
        "rank_state_kept": all(r["rank_state_kept"] for r in restores),
        "shards_equal_saved": not mismatched, "mismatched_shards": mismatched[:10],
        "shards_equal_dcp": dcp_equal,
    }
    ok = not mismatched and dcp_equal
    if ref is not None:
        start = out["resumed_at_update"]
        combined = {u: v for u, v in global_losses(pre).items() if u <= start}
        combined.update(global_losses(reports))
        out["losses_identical"] = combined == global_losses(ref)
        out["shards_identical"] = [r["digest"] for r in reports] == [r["digest"] for r in ref]
        ok = ok and out["losses_identical"] and out["shards_identical"]
    out["bitwise_identical"] = ok
    out["verdict"] = "bitwise identical" if ok else "MISMATCH"
    return out



def _restore_figures(strategy: str, restores: list[dict], served: dict) -> dict:
    """The figures of one restore (``restores``: every rank's, in rank order) for the table."""
    seconds = max(r["seconds"] for r in restores)
    read = [r["bytes_read"] for r in restores]
    received = [r["bytes_received"] for r in restores]
    mapped = [r.get("bytes_mapped", 0) for r in restores]
    moved = max(a + b + c for a, b, c in zip(read, received, mapped, strict=True))
    return {
        "strategy": strategy, "plan": restores[0].get("plan") or restores[0]["strategy"],
        "reason": restores[0]["reason"],
        "checkpoint": restores[0]["checkpoint"], "resumed_at_update": restores[0]["num_updates"],
        "bytes_read_per_rank": read, "bytes_received_per_rank": received,
        "bytes_mapped_per_rank": mapped, "data_path": restores[0].get("data_path", ""),
        "host_shared_memory": restores[0].get("host_shared_memory", True),
        "served_bytes_per_host": served.get("served_bytes_per_host"),
        "served_bytes_other": served.get("served_bytes_other"),
        "seconds": round(seconds, 3), "mib_per_s": round(moved / max(seconds, 1e-9) / 2**20, 1),
        "restore_seconds": round(max(r.get("restore_seconds", r["seconds"]) for r in restores),
                                 3),
        "predicted_s": round(float(restores[0].get("predicted_s", 0.0)), 3),
        "predictions": restores[0].get("predictions", {}),
        "state_devices": restores[0]["state_devices"],
        "state_digests": [r.get("state_digest", "") for r in restores],
    }


def resume_verdict(strategy: str, res: PhaseResult, pre_losses: dict, ref_losses: dict,
             ref_digest: set, served: dict | None = None) -> dict:
    """A resume that trained on: its losses and final parameters against the reference's
    (``state_identical``, against the ``all_ranks`` resume, comes from :func:`check_states`)."""
    restores = [r["restore"] for r in res.reports]
    start = restores[0]["num_updates"]
    resumed = global_losses(res.reports)
    combined = {u: v for u, v in pre_losses.items() if u <= start}
    combined.update(resumed)
    digests = {r["digest"] for r in res.reports}
    losses_ok = combined == ref_losses
    params_ok = len(digests) == 1 and digests == ref_digest
    out = _restore_figures(strategy, restores, served or {})
    out.update(kind="resume", losses_identical=losses_ok, params_identical=params_ok,
               bitwise_identical=losses_ok and params_ok,
               verdict="bitwise identical" if losses_ok and params_ok else "MISMATCH")
    return out


def restore_verdict(strategy: str, restores: list[dict], served: dict | None = None) -> dict:
    """A restore-only plan: judged by :func:`check_states` (its state against the
    ``all_ranks`` resume's on every rank)."""
    out = _restore_figures(strategy, restores, served or {})
    out.update(kind="restore", bitwise_identical=False, verdict="MISMATCH")
    return out


def check_states(rows: list[dict]) -> None:
    """Every row's restored state must equal the ``all_ranks`` row's on every rank (the
    :func:`~xla_ckpt.demo.worker.state_digest` of the state and the rank's own item): sets
    ``state_identical`` on each row and folds it into ``bitwise_identical`` / ``verdict``;
    a restore-only row also needs the ``all_ranks`` resume itself to be bitwise identical.
    """
    ref = next((r for r in rows if r["strategy"] == "all_ranks"), None)
    ref_states = ref["state_digests"] if ref is not None else None
    ref_ok = ref is not None and ref["bitwise_identical"]
    for r in rows:
        same = (ref_states is not None and all(ref_states)
                and r["state_digests"] == ref_states)
        r["state_identical"] = same
        ok = same and (r["bitwise_identical"] if r["kind"] == "resume" else ref_ok)
        r["bitwise_identical"] = ok
        r["verdict"] = "bitwise identical" if ok else "MISMATCH"


# ---- the local-tier leg ----------------------------------------------------------------------
_TENSOR_RE = re.compile(r"\(tensor (.*)\); those bytes come from the durable tier$")


def _ref_digest(ref: list[dict], at: int) -> str | None:
    """The reference's parameter digest after update ``at`` (its final one, or one it
    recorded with ``--digest-every``); None when it has none there."""
    r = ref[0]
    if r.get("num_updates") == at:
        return r.get("digest")
    return (r.get("digests") or {}).get(str(at))


def local_hosts(res: PhaseResult, hosts: int, served: dict | None) -> list[dict]:
    """Per emulated host of a relaunch: the tier its ranks restored from, local and durable
    bytes (the library's counters, summed over the host's ranks), the bytes the proxy served
    to the host's address from the relaunch to the end of the restore (``gcs_bytes``: every
    body; ``gcs_data_bytes``: data files' only, the checkpoint's tensor bytes;
    ``gcs_metadata_bytes``: the rest, the listing, pointers, lease and manifest the decision
    reads), the fallbacks, and the times in seconds from the relaunch (the
    slowest rank of the host; ``decide_s``, ``read_s`` (``local_read_s`` / ``durable_read_s``
    of it spent reading each tier) and ``restore_s`` are durations)."""
    reports = res.reports
    n = len(reports)
    t0 = res.started_unix
    wait = float(reports[0].get("timeline", {}).get("count_wait_s") or 0.0)
    by_host: dict[int, list[tuple[int, dict]]] = {}
    for rank, r in enumerate(reports):
        tier = (r.get("restore") or {}).get("tier") or {}
        by_host.setdefault(int(tier.get("host", rank * hosts // max(n, 1))), []).append(
            (rank, r))
    rows = []
    for h in sorted(by_host):
        ranks = by_host[h]
        tls = [r.get("timeline", {}) for _, r in ranks]
        trs = [(r.get("restore") or {}).get("tier") or {} for _, r in ranks]

        def after(key: str, tls: list[dict] = tls, minus: float = 0.0) -> float | None:
            if not all(t.get(key) for t in tls):
                return None
            # >= 0: the kernel's process start time has a 10 ms resolution
            return round(max(0.0, max(t[key] for t in tls) - t0 - minus), 3)

        tiers = sorted({t.get("tier") or "none" for t in trs})
        rows.append({
            "host": h, "ranks": [rank for rank, _ in ranks],
            "tier": "/".join(tiers), "restored": ranks[0][1]["restore"]["checkpoint"],
            "local_bytes": sum(int(t.get("local_bytes") or 0) for t in trs),
            "durable_bytes": sum(int(t.get("durable_bytes") or 0) for t in trs),
            "peer_bytes": sum(int(t.get("peer_bytes") or 0) for t in trs),
            "healed_from": next((t["healed_from"] for t in trs
                                 if t.get("healed_from") is not None), None),
            "gcs_bytes": served["served_bytes_per_host"][h] if served else None,
            "gcs_data_bytes": (served["served_data_bytes_per_host"][h] if served else None),
            "gcs_metadata_bytes": (served["served_bytes_per_host"][h]
                                   - served["served_data_bytes_per_host"][h] if served
                                   else None),
            "fallbacks": [f for t in trs for f in t.get("fallbacks") or []],
            "times": {
                "process_start_s": after("process_start"), "dist_init_s": after("dist_init"),
                "restore_start_s": after("restore_start"),
                "decide_s": round(max(float(t.get("decide_s") or 0.0) for t in trs), 3),
                "read_s": round(max(float(t.get("read_s") or 0.0) for t in trs), 3),
                "local_read_s": round(max(float(t.get("local_read_s") or 0.0) for t in trs), 3),
                "durable_read_s": round(max(float(t.get("durable_read_s") or 0.0)
                                            for t in trs), 3),
                "restore_s": round(max(float(t.get("total_s") or 0.0) for t in trs), 3),
                "restore_end_s": after("restore_end"),
                "first_step_s": after("first_step", minus=wait)}})
    return rows


def local_verdict(kind: str, res: PhaseResult, ref: PhaseResult, *, served: dict | None,
                  hosts: int, expect: str, expect_updates: int, newest_durable: str | None,
                  newest_durable_updates: int, flipped: dict | None,
                  replaced: int | None = None) -> dict:
    """One relaunch of the local-tier leg, judged (every check must hold).

    ``kind`` ``"crash"`` (after SIGKILL): every host restored ``expect``, the newest local
    step, newer than the newest durable one, from tier ``local``, with no fallback and no
    byte of a checkpoint data file from GCS (the proxy's count per host; without a proxy the
    library's ``durable_bytes``).  ``"flipped"`` (one byte of ``flipped["tensor"]`` flipped
    in host ``flipped["host"]``'s local copy of ``expect``): every host restored ``expect``
    from tier ``local``; that host's fallbacks are one, naming exactly that tensor, and it
    fetched data bytes from GCS while reading the rest locally; no other host fell back or
    fetched data bytes.  ``"replaced"`` (host ``replaced``'s local folder deleted): as
    ``"crash"``, and that host's part came from another host's replica (``healed_from``,
    ``peer_bytes`` > 0), no other host's.  All: the losses the relaunch trained equal the
    reference's and so do the parameters where it stopped (``ref``: the uninterrupted run,
    with digests every durable step)."""
    reports = res.reports
    restores = [r["restore"] for r in reports]
    start = restores[0]["num_updates"]
    last = reports[0]["num_updates"]
    resumed = global_losses(reports)
    ref_losses = global_losses(ref.reports)
    digests = {r["digest"] for r in reports}
    want = _ref_digest(ref.reports, last)
    per_host = local_hosts(res, hosts, served)
    by_proxy = served is not None
    data = [h["gcs_data_bytes"] if by_proxy else h["durable_bytes"] for h in per_host]
    checks: dict[str, bool] = {
        "tier_local_on_every_host": all(h["tier"] == "local" for h in per_host),
        "restored_newest_local": all(r["checkpoint"] == expect for r in restores)
        and start == expect_updates and (
            expect_updates > newest_durable_updates if kind == "crash"
            else expect_updates >= newest_durable_updates),
    }
    if flipped is None:
        checks["no_fallback"] = not any(h["fallbacks"] for h in per_host)
        checks["no_gcs_data_bytes"] = all(b == 0 for b in data)
    else:
        fh = flipped["host"]
        named = [m.group(1) for f in next(
            (h["fallbacks"] for h in per_host if h["host"] == fh), [])
            if (m := _TENSOR_RE.search(f))]
        checks["fallback_names_the_tensor"] = (
            named == [flipped["tensor"]]
            and all(not h["fallbacks"] for h in per_host if h["host"] != fh))
        checks["gcs_data_bytes_only_for_it"] = all(
            (b > 0 and h["local_bytes"] > 0) if h["host"] == fh else b == 0
            for h, b in zip(per_host, data, strict=True))
    if replaced is not None:
        checks["healed_from_a_replica"] = all(
            (h["healed_from"] is not None and h["healed_from"] != replaced
             and h["peer_bytes"] > 0) if h["host"] == replaced
            else (h["healed_from"] is None and h["peer_bytes"] == 0) for h in per_host)
    checks["losses_identical"] = (sorted(resumed) == list(range(start + 1, last + 1))
                                  and all(ref_losses.get(u) == v for u, v in resumed.items()))
    checks["params_identical"] = want is not None and digests == {want}
    ok = all(checks.values())
    return {"restore": kind, "restored": restores[0]["checkpoint"], "resumed_at_update": start,
            "stopped_at_update": last, "newest_local": expect,
            "newest_local_update": expect_updates, "newest_durable": newest_durable,
            "newest_durable_update": newest_durable_updates, "flipped": flipped,
            "replaced_host": replaced,
            "gcs_counted_by": "proxy" if by_proxy else "library (durable_bytes)",
            "gcs_bytes_other": served.get("served_bytes_other") if served else None,
            "hosts": per_host, "checks": checks,
            "failed_checks": [k for k, v in checks.items() if not v],
            "bitwise_identical": ok, "verdict": "bitwise identical" if ok else "MISMATCH"}


def bytes_by_saving_host(table: dict, saved: list[dict], hosts: int) -> list[int]:
    """The bytes of a restored shard table (:func:`xla_ckpt.demo.fsdp.shard_table`) that lie in
    each emulated host's saved part: per host ``h``, the overlap of every restored box with the
    boxes the ranks of host ``h`` saved (``saved``: every saving rank's table, in rank order;
    rank ``r`` of ``n`` on host ``r * hosts // n``).  0-dim values (AdamW's replicated
    ``step``) are left out: every rank holds them."""
    n = len(saved)
    out = [0] * hosts
    for key, e in table.items():
        if not e["sizes"]:
            continue
        numel = 1
        for s in e["sizes"]:
            numel *= s
        item = e["nbytes"] // numel if numel else 0
        for r, theirs in enumerate(saved):
            b = theirs.get(key)
            if b is None:
                continue
            overlap = 1
            for o, s, bo, bs in zip(e["offsets"], e["sizes"], b["offsets"], b["sizes"],
                                    strict=True):
                overlap *= max(0, min(o + s, bo + bs) - max(o, bo))
            out[r * hosts // n] += overlap * item
    return out


def tier_resharded_verdict(row: dict, res: PhaseResult, *, hosts: int, served: dict | None,
                           checkpoint_name: str, preempted_at: int,
                           saved: list[dict] | None = None) -> dict:
    """The sharded leg's restore from the tiers onto half the workers (``tier_resharded``),
    judged: ``row`` is its :func:`sharded_verdict` (shards against the saved global tensors
    and DCP's restore), ``res`` the phase (every rank's report carries ``RestoreResult.tier``).

    Every check must hold: the shards equal the saved global tensors and DCP's restore; every
    rank restored from tier ``local`` with ``durable_bytes`` 0 and no fallback; no byte of a
    checkpoint data file came from GCS (the proxy's count per host, ``served``; as in
    :func:`local_verdict` the decision's reads of the listing, pointers, lease and manifest
    are allowed; without a proxy the library's ``durable_bytes``); every one of the ``hosts``
    hosts took part; the restore is ``checkpoint_name`` at the preempted update
    ``preempted_at``.  Adds per host (:func:`local_hosts`) the bytes by tier (``local_bytes``,
    ``peer_bytes``, ``durable_bytes``, ``gcs_data_bytes``...) and their totals
    (``bytes_by_tier``); with ``saved`` (every saving rank's shard table) also
    ``shard_bytes_by_saving_host``: of the host's restored shards, the bytes that lie in each
    host's saved part (:func:`bytes_by_saving_host`; another host's: read from the replica it
    holds, or from a peer or GCS)."""
    restores = [r["restore"] for r in res.reports]
    tiers = [r.get("tier") or {} for r in restores]
    per_host = local_hosts(res, hosts, served)
    for h in per_host:
        h["restored"] = restores[h["ranks"][0]].get("checkpoint_name") or h["restored"]
        if saved is not None:
            parts = [bytes_by_saving_host(restores[rank]["shards"], saved, hosts)
                     for rank in h["ranks"]]
            h["shard_bytes_by_saving_host"] = [sum(p) for p in zip(*parts, strict=True)]
    by_proxy = served is not None
    checks = {
        "shards_equal_saved": bool(row["shards_equal_saved"]),
        "shards_equal_dcp": bool(row["shards_equal_dcp"]),
        "tier_local_on_every_rank": all(t.get("tier") == "local" for t in tiers),
        "no_durable_bytes": all(t.get("durable_bytes") == 0 for t in tiers),
        "no_fallback": not any(t.get("fallbacks") for t in tiers),
        "no_gcs_data_bytes": all((h["gcs_data_bytes"] if by_proxy else h["durable_bytes"]) == 0
                                 for h in per_host),
        "every_host_restored": [h["host"] for h in per_host] == list(range(hosts)),
        "resumed_at_preempted_update": row["resumed_at_update"] == preempted_at and all(
            r.get("checkpoint_name") == checkpoint_name for r in restores),
    }
    ok = all(checks.values())
    out = dict(row)
    out.update(
        hosts=per_host, restored=checkpoint_name,
        tiers_per_rank=[t.get("tier") or "none" for t in tiers],
        bytes_by_tier={k: sum(int(h[k] or 0) for h in per_host)
                       for k in ("local_bytes", "peer_bytes", "durable_bytes")},
        gcs_counted_by="proxy" if by_proxy else "library (durable_bytes)",
        gcs_bytes_other=served.get("served_bytes_other") if served else None,
        checks=checks, failed_checks=[k for k, v in checks.items() if not v],
        bitwise_identical=ok, verdict="bitwise identical" if ok else "MISMATCH")
    return out


def _grid(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))
                     for row in rows)
    return line + "\n" + sep + "\n" + body


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{b / 2**20:.0f}" for b in values)


def format_table(report: dict) -> str:
    """The human-readable tables ``xla-ckpt demo`` prints (one per leg that ran)."""
    hosts = report.get("hosts", 1)
    out = (f"xla_ckpt demo: {report['workers']} workers, model {report['model']}, "
           f"{report['updates']} updates, storage {report['storage']}\n")
    if report.get("restores"):
        link = report.get("restore_link")
        where = ""
        if link:
            where = (f" through a link per host ({link['first_byte_latency_s'] * 1000:.0f} ms "
                     f"first byte, {link['stream_mib_s']:.0f} MiB/s per stream, "
                     f"{link['host_mib_s']:.0f} MiB/s per host)")
        out += (f"{hosts} emulated host(s) x {report['workers'] // max(hosts, 1)} workers; "
                f"preempted (SIGTERM) after update {report['preempted_at_update']}; "
                f"restoring {report['checkpoint']}{where}\n")
        cols: tuple[str, ...] = (
            "strategy", "plan", "MiB read/rank", "MiB recv/rank", "MiB mapped/rank",
            "MiB served/host", "predicted s", "seconds", "on device", "checked", "verdict")
        rows: list[tuple[str, ...]] = []
        for r in report["restores"]:
            served = r.get("served_bytes_per_host")
            strategy = r["strategy"]
            if strategy == "all_ranks" and r.get("host_shared_memory") is False:
                strategy += "*"
            rows.append((strategy, r.get("plan") or r["strategy"],
                         _mib(r["bytes_read_per_rank"]), _mib(r["bytes_received_per_rank"]),
                         _mib(r.get("bytes_mapped_per_rank",
                                    [0] * len(r["bytes_read_per_rank"]))),
                         _mib(served) if served is not None else "-",
                         f"{r['predicted_s']:.2f}" if r.get("predicted_s") else "-",
                         f"{r.get('restore_seconds', r['seconds']):.2f}",
                         ",".join(r["state_devices"]),
                         "resume" if r.get("kind", "resume") == "resume" else "state",
                         r["verdict"]))
        out += _grid(cols, rows)
        if any(r["strategy"] == "all_ranks" and r.get("host_shared_memory") is False
               for r in report["restores"]):
            out += "\n* restore.host_shared_memory=false: every rank reads everything"
    sh = report.get("sharded")
    if sh:
        if report.get("restores"):
            out += "\n\n"
        out += (f"FSDP2 (fully_shard per layer, {sh['workers']} workers): preempted (SIGTERM) "
                f"after update {sh['preempted_at_update']}; restoring {sh['checkpoint_name']}\n")
        cols = ("restore", "workers", "MiB read/rank", "MiB shards/rank", "seconds",
                "= saved", "= DCP", "resume", "verdict")
        rows = []
        for r in sh["restores"]:
            resume = "-"
            if "losses_identical" in r:
                resume = ("bitwise" if r["losses_identical"] and r["shards_identical"]
                          else "DIFFERS")
            verdict = r["verdict"]
            if r.get("failed_checks"):
                verdict = "FAIL: " + ", ".join(r["failed_checks"])
            rows.append((r["restore"].replace("_", " "),
                         f"{r['saved_workers']}->{r['workers']}",
                         _mib(r["bytes_read_per_rank"]), _mib(r["shard_bytes_per_rank"]),
                         f"{r['seconds']:.2f}", "yes" if r["shards_equal_saved"] else "NO",
                         "yes" if r["shards_equal_dcp"] else "NO", resume, verdict))
        out += _grid(cols, rows)
        tr = next((r for r in sh["restores"] if r.get("hosts")), None)
        if tr is not None:
            out += "\n\n" + _tier_table(sh, tr)
        elif sh.get("tier_resharded_skipped"):
            out += f"\ntier resharded: not run ({sh['tier_resharded_skipped']})"
    loc = report.get("local")
    if loc:
        if report.get("restores") or sh:
            out += "\n\n"
        out += _local_table(loc)
    return out


def _tier_table(sh: dict, r: dict) -> str:
    """The sharded leg's restore from the tiers, per emulated host: the tier, the bytes from
    each (local, peer, durable: the library's counters) and what GCS served (the proxy's)."""
    hosts = len(r["hosts"])
    out = (f"tier resharded ({sh['workers']} workers on {hosts} emulated hosts -> "
           f"{r['workers']} on {hosts}; local tier {sh.get('local_dir', '-')}, "
           f"local_replicas={sh.get('local_replicas', '-')}): restored {r['restored']}, "
           f"GCS counted by {r['gcs_counted_by']}\n")
    cols = ("host", "ranks", "tier", "MiB shards by saving host", "MiB local", "MiB peer",
            "MiB durable", "MiB GCS data", "KiB GCS all", "fallbacks")
    rows = []
    for h in r["hosts"]:
        by = h.get("shard_bytes_by_saving_host")
        rows.append((str(h["host"]), ",".join(map(str, h["ranks"])), h["tier"],
                     "-" if by is None else "/".join(f"{b / 2**20:.3f}" for b in by),
                     f"{h['local_bytes'] / 2**20:.1f}", f"{h['peer_bytes'] / 2**20:.1f}",
                     f"{h['durable_bytes'] / 2**20:.1f}",
                     "-" if h["gcs_data_bytes"] is None else f"{h['gcs_data_bytes'] / 2**20:.1f}",
                     "-" if h["gcs_bytes"] is None else f"{h['gcs_bytes'] / 1024:.0f}",
                     str(len(h["fallbacks"]))))
    return out + _grid(cols, rows)


def _local_table(loc: dict) -> str:
    """The local-tier leg's table: one row per relaunch and emulated host."""
    crash = loc["restores"][0]
    out = (f"local tier ({loc['hosts']} emulated host(s) x "
           f"{loc['workers'] // max(loc['hosts'], 1)} workers, a folder each; local saves every "
           f"update, durable every {loc['save_interval_updates']}): SIGKILL after update "
           f"{loc['crashed_after_update']}; newest local {crash['newest_local']}, newest "
           f"durable {crash['newest_durable'] or '-'}\n")
    cols = ("relaunch", "host", "tier", "restored", "MiB local", "MiB peer", "MiB GCS data",
            "KiB GCS all",
            "fallback", "dist init s", "decide s", "read s", "1st step s", "verdict")
    rows = []
    for r in loc["restores"]:
        for h in r["hosts"]:
            t = h["times"]
            fb = "-"
            if h["fallbacks"]:
                m = _TENSOR_RE.search(h["fallbacks"][0])
                fb = (m.group(1) if m else h["fallbacks"][0][:40]) + (
                    f" (+{len(h['fallbacks']) - 1})" if len(h["fallbacks"]) > 1 else "")
            gcs = h["gcs_data_bytes"] if h["gcs_data_bytes"] is not None else h["durable_bytes"]

            def sec(v: float | None) -> str:
                return "-" if v is None else f"{v:.2f}"
            rows.append((r["restore"] if h is r["hosts"][0] else "", str(h["host"]), h["tier"],
                         h["restored"], f"{h['local_bytes'] / 2**20:.0f}",
                         f"{h.get('peer_bytes', 0) / 2**20:.1f}"
                         + (f" (host {h['healed_from']})" if h.get("healed_from") is not None
                            else ""),
                         f"{gcs / 2**20:.1f}",
                         "-" if h["gcs_bytes"] is None else f"{h['gcs_bytes'] / 1024:.0f}", fb,
                         sec(t["dist_init_s"]), sec(t["decide_s"]), sec(t["read_s"]),
                         sec(t["first_step_s"]),
                         r["verdict"] if not r["failed_checks"] else
                         "FAIL: " + ", ".join(r["failed_checks"])))
    return out + _grid(cols, rows)


def restore_leg(key: str) -> tuple[str, str]:
    """``(leg, restore)`` of a ``report["bitwise_identical"]`` key: ``"fsdp_resharded"`` ->
    ``("fsdp", "resharded")``, ``"local_crash"`` -> ``("local", "crash")``, ``"striped"`` ->
    ``("ddp", "striped")``."""
    for leg in ("fsdp", "local"):
        if key.startswith(f"{leg}_"):
            return leg, key.removeprefix(f"{leg}_")
    return "ddp", key


def verdict_line(report: dict, seconds: float) -> str:
    """The demo's last line: ``PASS: ...`` when every restore is bitwise identical, else
    ``FAIL: ...`` naming each failing restore by leg (``ddp (striped)``); ``seconds``: the
    whole demo's wall time."""
    results = report.get("bitwise_identical", {})
    by_leg: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {}
    for key, ok in results.items():
        leg, name = restore_leg(key)
        by_leg.setdefault(leg, []).append(name)
        if not ok:
            failed.setdefault(leg, []).append(name)
    if not results:
        legs = ", ".join(report.get("legs", []))
        return f"FAIL: no restore was checked (legs {legs}) in {seconds:.0f} s"
    if failed:
        bad = ", ".join(f"{leg} ({', '.join(names)})" for leg, names in failed.items())
        n_bad = sum(len(v) for v in failed.values())
        return (f"FAIL: not bitwise identical: {bad}; {len(results) - n_bad} of "
                f"{len(results)} restores passed in {seconds:.0f} s")
    good = ", ".join(f"{leg} ({', '.join(names)})" for leg, names in by_leg.items())
    return (f"PASS: every restore bitwise identical: {good}; {len(results)} restores in "
            f"{seconds:.0f} s")


def failure_line(error: BaseException, seconds: float) -> str:
    """The demo's last line when it could not finish: ``FAIL: leg <leg> did not finish:
    <the error's first line>``."""
    leg = getattr(error, "leg", "")
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = f"leg {leg} did not finish" if leg else "the demo did not finish"
    return f"FAIL: {where}: {text} (after {seconds:.0f} s)"

