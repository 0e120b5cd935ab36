"""Meters and the metrics registry: fairseq state_dict layout and values, through a real
checkpoint."""

from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.trainer import (
    AverageMeter,
    MetersDict,
    Metrics,
    StopwatchMeter,
    SumMeter,
    TimeMeter,
    register_meter,
)


class FakeClock:
    """A clock the test moves by hand (meters read it; no sleeping)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def meter(metrics: Metrics, name: str, key: str) -> Any:
    """``metrics.get_meter(name, key)``, which must be there (typed Any: tests read its fields)."""
    found = metrics.get_meter(name, key)
    assert found is not None
    return found


def test_average_meter_weighted_average_and_state_layout():
    m = AverageMeter(round=3)
    m.update(2.0, 3)
    m.update(4.0, 1)
    m.update(9.0, 0)  # weight 0: latest value only
    assert (m.val, m.sum, m.count) == (9.0, 10.0, 4)
    assert m.avg == 2.5
    assert m.state_dict() == {"val": 9.0, "sum": 10.0, "count": 4, "round": 3}
    n = AverageMeter()
    n.load_state_dict(m.state_dict())
    assert (n.val, n.sum, n.count, n.round) == (9.0, 10.0, 4, 3)


def test_average_meter_keeps_tensor_and_numpy_types():
    m = AverageMeter()
    m.update(torch.tensor(1.5), 2)
    assert isinstance(m.sum, torch.Tensor) and float(m.sum) == 3.0
    k = AverageMeter()
    k.update(np.float64(0.25), np.int64(4))
    assert type(k.sum) is np.float64 and k.sum == 1.0


def test_sum_meter():
    m = SumMeter()
    m.update(3)
    m.update(4)
    assert m.state_dict() == {"sum": 7, "round": None}
    assert m.smoothed_value == 7


def test_time_meter_saves_elapsed_and_restarts_from_it():
    clock = FakeClock(10.0)
    m = TimeMeter(clock=clock)
    m.update(30)
    clock.t = 13.0
    assert m.state_dict() == {"init": 3.0, "n": 30, "round": None}
    assert m.avg == 10.0
    clock2 = FakeClock(500.0)
    r = TimeMeter(clock=clock2)
    r.load_state_dict({"init": 3.0, "n": 30, "round": 2})
    clock2.t = 503.0  # 3 s more after the restart
    assert (r.init, r.n, r.round) == (3.0, 30, 2)
    assert r.elapsed_time == 6.0 and r.avg == 5.0


def test_time_meter_reads_fairseq_oldest_layout():
    r = TimeMeter(clock=FakeClock(0.0))
    r.load_state_dict({"init": 7.0, "start": 123.0})
    assert (r.init, r.n) == (7.0, 0)


def test_stopwatch_meter_sum_and_load_stops_it():
    clock = FakeClock(0.0)
    m = StopwatchMeter(clock=clock)
    m.start()
    clock.t = 1.5
    m.stop(n=2)
    assert (m.sum, m.n, m.avg) == (1.5, 2, 0.75)
    r = StopwatchMeter()
    r.start()
    r.load_state_dict(m.state_dict())
    assert (r.sum, r.n, r.start_time) == (1.5, 2, None)


def test_meters_dict_orders_by_priority_and_skips_derived_meters():
    md = MetersDict()
    md.add_meter("b", AverageMeter(), 20)
    md.add_meter("a", AverageMeter(), 10)
    md.add_meter("c", SumMeter(), 20)
    md["a"].update(1.0)
    m = Metrics()
    m.log_derived("ppl", lambda meters: 2 ** meters["loss"].avg)
    assert list(md) == ["a", "b", "c"]
    assert md.state_dict() == [
        (10, "a", "AverageMeter", {"val": 1.0, "sum": 1.0, "count": 1, "round": None}),
        (20, "b", "AverageMeter", {"val": None, "sum": 0, "count": 0, "round": None}),
        (20, "c", "SumMeter", {"sum": 0, "round": None}),
    ]
    assert m.state_dict() == OrderedDict([("default", [])])
    with pytest.raises(KeyError, match="already exists"):
        md.add_meter("a", AverageMeter(), 5)


def test_meters_dict_unknown_class_names_it():
    md = MetersDict()
    with pytest.raises(CheckpointCorruptError) as e:
        md.load_state_dict([(10, "gnorm", "FancyMeter", {})])
    assert str(e.value) == ("meter 'gnorm' has class 'FancyMeter', which is not registered; call "
                            "xla_ckpt.trainer.register_meter(<class>) before restoring, or pass "
                            "reset_meters=True")


def test_register_meter_makes_custom_class_restorable():
    @register_meter
    class MaxMeter(AverageMeter):
        pass

    md = MetersDict()
    md.load_state_dict([(3, "peak", "MaxMeter", {"val": 7, "sum": 7, "count": 1})])
    assert type(md["peak"]) is MaxMeter and md["peak"].sum == 7
    with pytest.raises(ValueError, match="already registered"):
        register_meter(type("MaxMeter", (AverageMeter,), {}))


def test_aggregate_nesting_and_new_root():
    m = Metrics()
    with m.aggregate("train"):
        m.log_scalar("loss", 4.0, weight=2)
        with m.aggregate("train_inner"):
            m.log_scalar("loss", 1.0, weight=2)
    with m.aggregate("valid", new_root=True):
        m.log_scalar("loss", 9.0)
    assert m.get_smoothed_values("train")["loss"] == 2.5
    assert m.get_smoothed_values("train_inner")["loss"] == 1.0
    assert m.get_smoothed_values("default")["loss"] == 2.5  # valid was a new root
    assert m.get_smoothed_values("valid")["loss"] == 9.0
    with pytest.raises(ValueError, match="'default' is always active"):
        with m.aggregate("default"):
            pass


def test_reset_meters_and_time_meters():
    m = Metrics()
    with m.aggregate("train"):
        m.log_scalar("loss", 3.0)
        m.log_speed("wps", 10.0)
        m.log_speed("wps", 10.0)
    assert meter(m, "train", "wps").n == 10.0
    assert m.reset_time_meters() == 2  # default and train
    assert meter(m, "train", "wps").n == 0 and meter(m, "default", "wps").n == 0
    assert meter(m, "train", "loss").sum == 3.0
    m.reset_meters("train")
    assert meter(m, "train", "loss").sum == 0
    assert meter(m, "default", "loss").sum == 3.0
    assert m.get_meter("nope", "loss") is None and m.get_meters("nope") is None


def test_metrics_state_round_trips_through_a_checkpoint(local_dir):
    m = Metrics()
    with m.aggregate("train"):
        m.log_scalar("loss", torch.tensor(2.5), weight=8, round=3)
        m.log_scalar("bsz", np.float64(8.0), priority=190)
        m.log_scalar_sum("nsentences", 8)
        m.log_start_time("train_wall", priority=800)
        m.log_stop_time("train_wall")
    saved = m.state_dict()
    xla_ckpt.save({"metrics": saved}, local_dir)
    loaded = xla_ckpt.load(local_dir)["metrics"]
    assert_state_identical(loaded, saved)
    r = Metrics()
    r.load_state_dict(loaded)
    assert r.aggregator_names() == ["default", "train"]
    assert list(r.get_meters("train") or ()) == ["loss", "nsentences", "bsz", "train_wall"]
    assert float(meter(r, "train", "loss").sum) == 20.0
    assert type(meter(r, "train", "bsz").sum) is np.float64
    assert meter(r, "train", "nsentences").sum == 8
    assert meter(r, "train", "train_wall").start_time is None
