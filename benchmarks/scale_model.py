r"""Pod-scale simulation of the restore plans with the cost model of :mod:`xla_ckpt.restore.cost`.

No I/O and no timing: every figure is a prediction of ``xla_ckpt.restore.cost.estimate``, the
same function ``strategy="auto"`` uses.

**Calibration on Orbax's published rows.**  Orbax ("maximizing performance", scalable loading)
restored Llama 3.1 70B from GCS on ``n`` replicas of 64 VMs (one JAX process per VM, each VM
holding 1/64 of the model):

  n                                     2      4      16     32
  every replica reads (s)               27.9   51.8   156.0  231.1
  one replica reads, then broadcasts    35.3   33.3   38.5   46.9

In cost-model terms each row is ``hosts = 64 n``, ``ranks_per_host = 1``, ``replicas = n``
(each chunk is held by one VM of every replica), ``backend_kind = "xla"``; "every replica
reads" is the ``all_ranks`` plan and "one replica reads and broadcasts" is the ``broadcast``
plan (the first holder of each chunk reads it, a psum-style broadcast over DCN fans it out).
The state is taken as 70.6e9 bfloat16 parameters (141.2 GB); the calibrated bandwidths scale
with that assumption, the predicted seconds do not.

Exactly three parameters are calibrated, on the n = 2 and n = 32 rows only:

* ``storage_host_bytes_per_s`` and ``storage_total_bytes_per_s``: solved exactly from the two
  every-replica rows (the model is linear in their inverses while the host cap binds);
* ``data_plane_cross_host_bytes_per_s``: the least-squares fit (relative error) of the two
  broadcast rows, given the other two.

Every other parameter keeps its documented default (:class:`~xla_ckpt.restore.cost.Bandwidths`).
The n = 4 and n = 16 rows are then predicted, and the run fails (exit 1) if any prediction is
off by more than 30 %.  Beside each row: our ``striped`` plan on the same topology (each VM
fetches 1/n of its slice; an all-gather across the n holders), and what ``auto`` picks on XLA
with and without ``restore.allow_xla_data_plane``.

**The grid.**  The same calibrated model over 1-64 hosts x 1-8 ranks per host x 1-32 replicas
of each chunk (``replicas <= world size``; a replicated state is ``replicas = world size``,
marked ``*``), for the same 141.2 GB state: every plan's predicted seconds, Orbax's method (the
``broadcast`` plan on XLA, as calibrated) beside ours (``striped``), the storage bytes per job
of each, and ``auto``'s pick on XLA (``allow_xla_data_plane`` false, then true) and on NCCL.

**Against our own emulation** (``--check-emulation FILE``): FILE holds the JSON lines of
``benchmarks/striped_restore.py`` (emulated hosts on one machine, each behind its own shaped
link to the GCS emulator).  From its ``setup`` line (hosts, ranks per host, the checkpoint's
sizes, the shaping's storage figures and the probed ones: the series storage term, the
cross- and intra-host data-plane rates and the fixed seconds of a restore: ``bandwidths``)
the same model predicts every plan that ran (``auto``: the plan it picked), and each
prediction is compared with the measured median seconds of its ``plan`` line: within +-30 %
is met; the run fails (exit 1) if one is not.

Output: JSON lines (``{"kind": "calibration" | "orbax_row" | "grid" | "emulation_plan" |
"emulation_check", ...}``), then the tables.

  .venv/bin/python benchmarks/scale_model.py              # calibration, Orbax rows, grid
  .venv/bin/python benchmarks/scale_model.py --no-grid    # calibration and Orbax rows only
  .venv/bin/python benchmarks/scale_model.py --json       # JSON lines only
  .venv/bin/python benchmarks/scale_model.py --grid-bandwidths defaults  # grid on the defaults
  .venv/bin/python benchmarks/striped_restore.py > striped.jsonl
  .venv/bin/python benchmarks/scale_model.py --no-grid --check-emulation striped.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Sequence

from xla_ckpt.restore.cost import (
    ALL_RANKS,
    BROADCAST,
    PLANS,
    STRIPED,
    Bandwidths,
    RestoreSizes,
    RestoreTopology,
    choose_plan,
    estimate,
    predict,
)

#: Orbax's measured seconds: n -> (every replica reads, one replica reads and broadcasts).
ORBAX_ROWS: dict[int, tuple[float, float]] = {2: (27.9, 35.3), 4: (51.8, 33.3),
                                              16: (156.0, 38.5), 32: (231.1, 46.9)}
ORBAX_HOSTS_PER_REPLICA = 64
CALIBRATE_ON = (2, 32)
PREDICT = (4, 16)
MAX_ERROR = 0.30
#: Llama 3.1 70B: about 70.6e9 parameters in bfloat16.
STATE_BYTES = int(70.6e9) * 2

GRID_HOSTS = (1, 2, 4, 8, 16, 32, 64)
GRID_RANKS = (1, 2, 4, 8)
GRID_REPLICAS = (1, 2, 4, 8, 16, 32)

CALIBRATED = ("storage_host_bytes_per_s", "storage_total_bytes_per_s",
              "data_plane_cross_host_bytes_per_s")


def orbax_topology(n: int) -> RestoreTopology:
    return RestoreTopology(hosts=ORBAX_HOSTS_PER_REPLICA * n, ranks_per_host=1, replicas=n,
                           replica_hosts=n)


def _seconds(plan: str, n: int, bw: Bandwidths, sizes: RestoreSizes) -> float:
    return estimate(plan, orbax_topology(n), sizes, bw, backend_kind="xla").seconds


def _linear_coefficients(plan: str, n: int, base: Bandwidths,
                         sizes: RestoreSizes) -> tuple[float, list[float]]:
    """``t = c0 + sum(c_i / p_i)`` over the calibrated parameters ``p_i``, around ``base``.

    The model is linear in the inverse bandwidths while the same caps bind, so two
    evaluations per parameter give its coefficient exactly.
    """
    t0 = _seconds(plan, n, base, sizes)
    coefs = []
    for name in CALIBRATED:
        p = getattr(base, name)
        t1 = _seconds(plan, n, dataclasses.replace(base, **{name: p / 2}), sizes)
        coefs.append((t1 - t0) * p)  # d t / d (1/p), since 1/(p/2) - 1/p = 1/p
    c0 = t0 - sum(c / getattr(base, name) for c, name in zip(coefs, CALIBRATED, strict=True))
    return c0, coefs


def calibrate(sizes: RestoreSizes) -> Bandwidths:
    """The three calibrated parameters fitted on the n = 2 and n = 32 rows (others default).

    Raises:
        RuntimeError: the fit leaves the region where it is valid (the host cap stops binding)
            or gives a non-positive bandwidth.
    """
    # A starting point inside the region the rows live in (host-link bound, not stream bound).
    base = dataclasses.replace(Bandwidths(), storage_host_bytes_per_s=100e6,
                               storage_total_bytes_per_s=20e9,
                               data_plane_cross_host_bytes_per_s=100e6)
    lo, hi = CALIBRATE_ON
    (a0, (a_h, a_t, _)), (b0, (b_h, b_t, _)) = (_linear_coefficients(ALL_RANKS, n, base, sizes)
                                                for n in (lo, hi))
    # Two every-replica rows: a0 + a_h x + a_t y = T_lo, b0 + b_h x + b_t y = T_hi.
    t_lo, t_hi = ORBAX_ROWS[lo][0], ORBAX_ROWS[hi][0]
    det = a_h * b_t - a_t * b_h
    x = ((t_lo - a0) * b_t - a_t * (t_hi - b0)) / det
    y = (a_h * (t_hi - b0) - (t_lo - a0) * b_h) / det
    if x <= 0 or y <= 0:
        raise RuntimeError(f"calibration failed: inverse bandwidths {x}, {y} are not positive")
    fitted = dataclasses.replace(base, storage_host_bytes_per_s=1 / x,
                                 storage_total_bytes_per_s=1 / y)
    # Two broadcast rows: minimise the sum of squared relative errors over 1/cross.
    num = den = 0.0
    for n in CALIBRATE_ON:
        c0, (c_h, c_t, c_x) = _linear_coefficients(BROADCAST, n, fitted, sizes)
        rest = (c0 + c_h / fitted.storage_host_bytes_per_s
                + c_t / fitted.storage_total_bytes_per_s)  # everything but the broadcast
        m = ORBAX_ROWS[n][1]
        num += c_x * (m - rest) / m ** 2
        den += c_x ** 2 / m ** 2
    z = num / den
    if z <= 0:
        raise RuntimeError(f"calibration failed: inverse cross-host bandwidth {z} <= 0")
    fitted = dataclasses.replace(fitted, data_plane_cross_host_bytes_per_s=1 / z)
    stream_cap = fitted.streams_per_reader * fitted.storage_stream_bytes_per_s
    if fitted.storage_host_bytes_per_s >= stream_cap:
        raise RuntimeError("calibration left its region: the fitted host cap "
                           f"{fitted.storage_host_bytes_per_s:.3g} B/s exceeds the streams' "
                           f"{stream_cap:.3g} B/s")
    return fitted


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1.0


def orbax_rows(bw: Bandwidths, sizes: RestoreSizes) -> list[dict[str, Any]]:
    rows = []
    for n, (every, one) in ORBAX_ROWS.items():
        t = orbax_topology(n)
        est = {p: estimate(p, t, sizes, bw, backend_kind="xla") for p in PLANS}
        pick_off = choose_plan(t, sizes, bw, runnable=set(PLANS), allow_xla_data_plane=False,
                               backend_kind="xla").plan
        pick_on = choose_plan(t, sizes, bw, runnable=set(PLANS), allow_xla_data_plane=True,
                              backend_kind="xla").plan
        orbax_best = min(every, one)
        rows.append({
            "kind": "orbax_row", "n": n, "hosts": t.hosts, "role": (
                "calibration" if n in CALIBRATE_ON else "prediction"),
            "every_replica_measured_s": every,
            "every_replica_predicted_s": round(est[ALL_RANKS].seconds, 2),
            "every_replica_error": round(_err(est[ALL_RANKS].seconds, every), 4),
            "broadcast_measured_s": one,
            "broadcast_predicted_s": round(est[BROADCAST].seconds, 2),
            "broadcast_error": round(_err(est[BROADCAST].seconds, one), 4),
            "striped_predicted_s": round(est[STRIPED].seconds, 2),
            "striped_storage_bytes_x_state": round(est[STRIPED].storage_bytes
                                                   / sizes.state_bytes, 3),
            "every_replica_storage_bytes_x_state": round(est[ALL_RANKS].storage_bytes
                                                         / sizes.state_bytes, 3),
            "striped_speedup_vs_orbax_best_measured": round(orbax_best / est[STRIPED].seconds, 2),
            "auto_xla": pick_off, "auto_xla_data_plane": pick_on,
        })
    return rows


def grid(bw: Bandwidths, sizes: RestoreSizes) -> list[dict[str, Any]]:
    rows = []
    for hosts in GRID_HOSTS:
        for ranks in GRID_RANKS:
            world = hosts * ranks
            for replicas in sorted({*(r for r in GRID_REPLICAS if r <= world)}):
                t = RestoreTopology(hosts=hosts, ranks_per_host=ranks, replicas=replicas)
                est = {p: estimate(p, t, sizes, bw, backend_kind="xla") for p in PLANS}
                picks = {
                    "auto_xla": choose_plan(t, sizes, bw, runnable=set(PLANS),
                                            allow_xla_data_plane=False, backend_kind="xla").plan,
                    "auto_xla_data_plane": choose_plan(t, sizes, bw, runnable=set(PLANS),
                                                       allow_xla_data_plane=True,
                                                       backend_kind="xla").plan,
                    "auto_nccl": choose_plan(t, sizes, bw, runnable=set(PLANS),
                                             allow_xla_data_plane=False,
                                             backend_kind="nccl").plan,
                }
                rows.append({
                    "kind": "grid", "hosts": hosts, "ranks_per_host": ranks, "world_size": world,
                    "replicas": replicas, "replica_hosts": t.holder_hosts,
                    "replicated": replicas == world,
                    **{f"{p}_s": round(e.seconds, 3) for p, e in est.items()},
                    **{f"{p}_storage_bytes_x_state": round(e.storage_bytes / sizes.state_bytes, 3)
                       for p, e in est.items()},
                    "orbax_method_s": round(est[BROADCAST].seconds, 3),
                    "striped_vs_orbax_method": round(est[BROADCAST].seconds
                                                     / est[STRIPED].seconds, 2),
                    **picks,
                })
    return rows


def check_emulation(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model's predictions against ``benchmarks/striped_restore.py``'s measured seconds.

    ``lines``: that script's JSON lines (one ``setup`` line, ``plan`` lines; others ignored).
    For each plan line with a measured ``seconds``, the plan that ran (``plan_ran``: ``auto``
    names the plan it picked) is predicted with :func:`~xla_ckpt.restore.cost.predict` on
    the setup line's topology, sizes, bandwidths and backend.

    Returns:
        One ``{"kind": "emulation_plan", ...}`` dict per plan, then one
        ``{"kind": "emulation_check", "met": ...}`` with the worst error.

    Raises:
        ValueError: no setup line, or no plan line with seconds (names what is missing).
    """
    setups = [x for x in lines if x.get("kind") == "setup"]
    if not setups:
        raise ValueError("no {\"kind\": \"setup\"} line: pass the JSON lines that "
                         "benchmarks/striped_restore.py printed")
    setup = setups[-1]
    topo = RestoreTopology(hosts=setup["hosts"], ranks_per_host=setup["ranks_per_host"])
    sizes = RestoreSizes(**setup["sizes"])
    bw = Bandwidths(**setup["bandwidths"])
    est = predict(topo, sizes, bw, backend_kind=setup["backend_kind"])
    out: list[dict[str, Any]] = []
    for x in lines:
        if x.get("kind") != "plan" or "seconds" not in x:
            continue
        ran = x.get("plan_ran", x["plan"])
        if not isinstance(ran, str) or ran not in est:
            out.append({"kind": "emulation_plan", "plan": x["plan"], "plan_ran": ran,
                        "measured_s": x["seconds"], "error": None,
                        "met": False, "why": "not one plan of the cost model"})
            continue
        pred = est[ran].seconds
        err = pred / x["seconds"] - 1.0
        out.append({"kind": "emulation_plan", "plan": x["plan"], "plan_ran": ran,
                    "measured_s": x["seconds"], "predicted_s": round(pred, 3),
                    "predicted_read_s": round(est[ran].read_s, 3),
                    "predicted_exchange_s": round(est[ran].exchange_s, 3),
                    "error": round(err, 4), "met": abs(err) <= MAX_ERROR,
                    "storage_bytes_x_state_predicted": round(est[ran].storage_bytes
                                                             / sizes.state_bytes, 3),
                    "bytes_per_job_x_checkpoint_measured": x.get("bytes_per_job_x_checkpoint")})
    if not out:
        raise ValueError("no {\"kind\": \"plan\"} line with measured seconds in the "
                         "emulation results")
    errs = [r["error"] if r["error"] is not None else float("inf") for r in out]
    worst = max(errs, key=abs)
    out.append({"kind": "emulation_check", "hosts": setup["hosts"],
                "ranks_per_host": setup["ranks_per_host"],
                "state_bytes": sizes.state_bytes, "backend_kind": setup["backend_kind"],
                "data_plane_cross_host_bytes_per_s": bw.data_plane_cross_host_bytes_per_s,
                "worst_error": round(worst, 4) if math.isfinite(worst) else None,
                "target": f"+-{MAX_ERROR:.0%}", "met": abs(worst) <= MAX_ERROR})
    return out


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else open(path).read()
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        raw = raw.strip()
        if not raw or raw.startswith("#"):
            continue
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
        if isinstance(doc, dict):
            out.append(doc)
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _pct(e: float) -> str:
    return f"{e * 100:+.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--no-grid", action="store_true", help="skip the 1-64 host grid")
    ap.add_argument("--json", action="store_true", help="JSON lines only, no tables")
    ap.add_argument("--grid-bandwidths", choices=("calibrated", "defaults"), default="calibrated",
                    help="the grid's parameters: the Orbax calibration (default) or the "
                         "documented defaults of xla_ckpt.restore.cost.Bandwidths")
    ap.add_argument("--check-emulation", metavar="FILE", default=None,
                    help="JSON lines of benchmarks/striped_restore.py ('-': stdin): check the "
                         "model's prediction of every plan against the measured seconds")
    a = ap.parse_args(argv)
    emulation: list[dict[str, Any]] = []
    if a.check_emulation is not None:
        try:
            emulation = check_emulation(_read_jsonl(a.check_emulation))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--check-emulation {a.check_emulation}: {type(e).__name__}: {e}")

    sizes = RestoreSizes(state_bytes=STATE_BYTES)
    bw = calibrate(sizes)
    cal = {"kind": "calibration", "calibrated_on": list(CALIBRATE_ON), "state_bytes": STATE_BYTES,
           "calibrated": {k: round(getattr(bw, k)) for k in CALIBRATED},
           "defaults_kept": {f.name: getattr(bw, f.name) for f in dataclasses.fields(bw)
                             if f.name not in CALIBRATED},
           "request_bytes": sizes.request_bytes}
    orbax = orbax_rows(bw, sizes)
    predicted = [r for r in orbax if r["role"] == "prediction"]
    worst = max(abs(r[k]) for r in predicted for k in ("every_replica_error", "broadcast_error"))
    cal["worst_prediction_error"] = round(worst, 4)
    cal["within_30_percent"] = worst <= MAX_ERROR
    grid_bw = bw if a.grid_bandwidths == "calibrated" else Bandwidths()
    rows = [] if a.no_grid else grid(grid_bw, sizes)
    for line in [cal, *orbax, *rows, *emulation]:
        print(json.dumps(line), flush=True)
    if not a.json:
        print()
        print("Calibrated on Orbax n = 2 and n = 32 (3 parameters; every other one at its "
              "default):")
        for k in CALIBRATED:
            print(f"  {k} = {getattr(bw, k):.4g} B/s ({getattr(bw, k) / 1e6:.1f} MB/s)")
        print()
        print(_table(
            ["n", "hosts", "role", "every replica: measured", "predicted", "error",
             "one replica + broadcast: measured", "predicted", "error", "ours: striped",
             "striped vs Orbax's best", "storage x state: every replica / striped",
             "auto (XLA)", "auto (XLA data plane)"],
            [[r["n"], r["hosts"], r["role"], f"{r['every_replica_measured_s']} s",
              f"{r['every_replica_predicted_s']} s", _pct(r["every_replica_error"]),
              f"{r['broadcast_measured_s']} s", f"{r['broadcast_predicted_s']} s",
              _pct(r["broadcast_error"]), f"{r['striped_predicted_s']} s",
              f"{r['striped_speedup_vs_orbax_best_measured']}x",
              (f"{r['every_replica_storage_bytes_x_state']:g} / "
               f"{r['striped_storage_bytes_x_state']:g}"), r["auto_xla"],
              r["auto_xla_data_plane"]] for r in orbax]))
        print()
        print(f"Predictions (n = 4, 16): worst error {_pct(worst)} "
              f"({'within' if worst <= MAX_ERROR else 'OUTSIDE'} +/-30 %)")
        if rows:
            print()
            print(f"Grid: {STATE_BYTES / 1e9:.1f} GB, {a.grid_bandwidths} parameters, seconds "
                  "(* = replicated state); Orbax's method = broadcast on XLA")
            print(_table(
                ["hosts", "ranks/host", "replicas", "all_ranks", "per_host",
                 "Orbax method (broadcast)", "ours: striped", "striped vs Orbax",
                 "storage x state: all_ranks / striped", "auto XLA", "auto XLA data plane",
                 "auto NCCL"],
                [[r["hosts"], r["ranks_per_host"],
                  f"{r['replicas']}{'*' if r['replicated'] else ''}",
                  f"{r['all_ranks_s']:.3g}", f"{r['per_host_s']:.3g}", f"{r['broadcast_s']:.3g}",
                  f"{r['striped_s']:.3g}", f"{r['striped_vs_orbax_method']}x",
                  (f"{r['all_ranks_storage_bytes_x_state']:g} / "
                   f"{r['striped_storage_bytes_x_state']:g}"),
                  r["auto_xla"], r["auto_xla_data_plane"], r["auto_nccl"]] for r in rows]))
        if emulation:
            check = emulation[-1]
            print()
            print(f"Against our emulation ({check['hosts']} emulated hosts x "
                  f"{check['ranks_per_host']} ranks, {check['state_bytes'] / 2**20:.1f} MiB, "
                  f"{check['backend_kind']}; the model on the run's setup line):")
            print(_table(
                ["plan", "ran", "measured", "predicted (read + exchange)", "error", "met"],
                [[r["plan"], r["plan_ran"], f"{r['measured_s']} s",
                  (f"{r['predicted_s']} s ({r['predicted_read_s']} + "
                   f"{r['predicted_exchange_s']})" if "predicted_s" in r else "-"),
                  _pct(r["error"]) if r["error"] is not None else "-",
                  "met" if r["met"] else "not met"] for r in emulation[:-1]]))
            print(f"Emulation: worst error "
                  f"{_pct(check['worst_error']) if check['worst_error'] is not None else '-'}"
                  f" ({'met' if check['met'] else 'NOT MET'}: within +/-30 %)")
    ok = worst <= MAX_ERROR and (not emulation or emulation[-1]["met"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
