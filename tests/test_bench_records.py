"""bench.records: rounds summarised as the median round; validation of every field, old and new."""
from __future__ import annotations

import pytest

from bench import records

INFO = {"ranks": 2, "hosts": 1, "network": "local"}


def _record(**over):
    rec = records.make_record(bench="collectives", op="all_reduce", dtype="bfloat16",
                              size_bytes=64, info=INFO, times_s=(1e-6, 2e-6, 3e-6),
                              algbw_gbps=0.1, busbw_gbps=0.1, wire_bytes=128, wrong=0,
                              round_means_s=[2e-6, 5e-6, 1.5e-6], peer="mpicomm", count=32,
                              device="cpu", iters=3, warmup=1, check="exact")
    rec.update(over)
    return rec


def test_median_round_is_a_real_round():
    rounds = [(1.0, 3.0, 4.0), (0.5, 1.0, 2.0), (2.0, 2.5, 9.0)]
    assert records.median_round(rounds) == ((2.0, 2.5, 9.0), [3.0, 1.0, 2.5])
    # even count: the lower of the two middle rounds
    assert records.median_round(rounds + [(0, 9.0, 9.5)])[0] == (2.0, 2.5, 9.0)
    assert records.median_round([(1, 2, 3)])[0] == (1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="at least one round"):
        records.median_round([])


def test_round_fields():
    rec = _record()
    assert records.validate_record(rec) == []
    assert rec["rounds"] == 3 and rec["time_us_rounds"] == pytest.approx([2.0, 5.0, 1.5])
    assert (rec["time_us_round_min"], rec["time_us_round_max"]) == pytest.approx((1.5, 5.0))
    old = records.make_record(bench="x", op="all_reduce", dtype="float32", size_bytes=8,
                              info=INFO, times_s=(1, 1, 1), algbw_gbps=0, busbw_gbps=0,
                              wire_bytes=0, wrong=0)
    assert "rounds" not in old and records.validate_record(old) == []


@pytest.mark.parametrize("change,needle", [
    ({"time_us_rounds": [2.0, 5.0]}, "expected rounds = 3 values"),
    ({"time_us_round_min": 1.0}, "'time_us_round_min': expected 1.5"),
    ({"time_us_round_max": 1.9}, "time_us_round_min <= time_us_mean <= time_us_round_max"),
    ({"time_us_rounds": []}, "non-empty list"),
    ({"time_us_rounds": "2,5,1.5"}, "'time_us_rounds': expected list"),
    ({"rounds": 0}, "expected rounds = 0 values"),
    ({"time_us_min": 2.5}, "time_us_min <= time_us_mean <= time_us_max"),
    ({"device": "tpu"}, "'device': expected one of"),
    ({"wire_bytes_measured": -1}, "'wire_bytes_measured': expected >= 0"),
    ({"wire_bytes_measured": "4K"}, "'wire_bytes_measured': expected number"),
    ({"count": True}, "'count': expected int"),
    ({"algbw_gbps": float("nan")}, "'algbw_gbps': expected number"),
    ({"check": 0}, "'check': expected str"),
])
def test_bad_new_fields_are_named(change, needle):
    problems = records.validate_record(_record(**change))
    assert any(needle in p for p in problems), problems


def test_measured_wire_bytes_may_be_null():
    assert records.validate_record(_record(wire_bytes_measured=None)) == []
    assert records.validate_record(_record(wire_bytes_measured=4096)) == []
    assert records.validate_record(_record(wire_bytes_measured=4133.5)) == []  # mean per call
    rec = _record()
    del rec["time_us_round_max"]
    assert any("without time_us_round_max" in p for p in records.validate_record(rec))


def _train(**over):
    rec = {"bench": "train", "op": "step", "peer": "gloo", "ranks": 2, "hosts": 1,
           "network": "local", "model": "mlp 2x64", "params": 8320, "grad_bytes": 33280, "batch": 8, "steps": 4,
           "rounds": 2, "step_ms": 2.0, "step_ms_min": 1.5, "step_ms_max": 2.0,
           "step_ms_rounds": [2.0, 1.5], "samples_per_s": 8000.0, "loss": 0.5,
           "backward_ms": 1.0, "comm_ms": 0.5, "backward_comm_ms": 1.6, "overlap_ms": -0.1,
           "wrong": 0}
    rec.update(over)
    return rec


def test_train_records():
    assert records.validate_record(_train()) == []
    assert any("missing field 'loss'" in p for p in records.validate_record(
        {k: v for k, v in _train().items() if k != "loss"}))
    assert any("step_ms_min <= step_ms <= step_ms_max" in p
               for p in records.validate_record(_train(step_ms=3.0)))
    assert any("'samples_per_s': expected >= 0" in p
               for p in records.validate_record(_train(samples_per_s=-1.0)))
    curve = {"bench": "train", "op": "curve", "peer": "adam", "ranks": 2, "hosts": 1,
             "network": "local", "model": "mlp", "steps": 3, "losses": [1.0, 0.5, 0.25], "wrong": 0}
    assert records.validate_record(curve) == []
    assert any("expected steps = 4 values" in p
               for p in records.validate_record(dict(curve, steps=4)))
    assert records.validate_record([1]) == ["expected a record dict, got list"]


ENVELOPE = {"ranks": 2, "hosts": 1, "network": "local", "wrong": 0}


def test_every_kind_shares_the_envelope():
    for rec in (_record(), _train()):
        for name in records.ENVELOPE_FIELDS:
            assert any(f"missing field {name!r}" in p for p in records.validate_record(
                {k: v for k, v in rec.items() if k != name})), name


def test_ckpt_records():
    rec = dict(ENVELOPE, bench="ckpt", op="ckpt.load", size_bytes=4096, time_s=0.5, gbps=8e-6,
               note="state checked")
    assert records.validate_record(rec) == []
    # a row that did not run: no time, no size
    assert records.validate_record(dict(rec, size_bytes=None, time_s=None, gbps=None)) == []
    assert any("missing field 'note'" in p for p in records.validate_record(
        {k: v for k, v in rec.items() if k != "note"}))
    assert any("missing field 'wrong'" in p for p in records.validate_record(
        {k: v for k, v in rec.items() if k != "wrong"}))
    assert any("'time_s': expected >= 0" in p
               for p in records.validate_record(dict(rec, time_s=-1.0)))


def test_zero_records():
    base = dict(ENVELOPE, bench="zero", peer="ZeRO-1 Adam", params=100)
    mem = dict(base, op="memory", model_mib=1.0, peak_mib_per_rank=[3.0, 4.0], x_model=4.0,
               note="")
    assert records.validate_record(mem) == []
    assert records.validate_record(dict(mem, peak_mib_per_rank=None, x_model=None,
                                        note="did not run: ...")) == []
    nbytes = dict(base, op="bytes", bytes_per_step=800.0, x_model=2.0, by_call={"Allreduce": 40})
    assert records.validate_record(nbytes) == []
    assert any("missing field 'by_call'" in p for p in records.validate_record(
        {k: v for k, v in nbytes.items() if k != "by_call"}))
    assert any("expected one of" in p for p in records.validate_record(dict(base, op="speed")))
