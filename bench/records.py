"""JSON records of the bench programs: building them, summarising rounds, validating.

A record is one flat dict. Every record of every program starts with :data:`ENVELOPE_FIELDS`
(``bench``, ``op``, ``ranks``, ``hosts``, ``network``, ``wrong``); the rest depends on the kind:
measurement records (collectives, compressed, demo) carry :data:`RECORD_FIELDS` (the fields of
:data:`OPTIONAL_FIELDS` checked when present), ``bench train`` records :data:`TRAIN_FIELDS` or
:data:`CURVE_FIELDS`, ``bench compressed --crossover``'s results :data:`CROSSOVER_FIELDS`,
``bench ckpt`` records :data:`CKPT_FIELDS`, ``bench zero`` records :data:`ZERO_FIELDS` of their
op. bench/README.md describes every field.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["ENVELOPE_FIELDS", "RECORD_FIELDS", "OPTIONAL_FIELDS", "TRAIN_FIELDS", "CURVE_FIELDS",
           "CROSSOVER_FIELDS", "CKPT_FIELDS", "ZERO_FIELDS", "make_record", "median_round", "validate_record"]

_NUM = float  # int or float, never bool

# Fields every record of every program starts with.
ENVELOPE_FIELDS = {"bench": str, "op": str, "ranks": int, "hosts": int, "network": str,
                   "wrong": int}

# Fields every measurement record carries.
RECORD_FIELDS = {
    "bench": str, "op": str, "dtype": str, "size_bytes": int, "ranks": int, "hosts": int,
    "time_us_min": _NUM, "time_us_mean": _NUM, "time_us_max": _NUM,
    "algbw_gbps": _NUM, "busbw_gbps": _NUM, "wire_bytes": int, "wrong": int,
}

# Fields some programs add, checked when present (None allowed where the value is optional).
OPTIONAL_FIELDS = {
    "peer": str, "count": int, "iters": int, "warmup": int, "device": str, "network": str,
    "rounds": int, "time_us_rounds": list, "time_us_round_min": _NUM, "time_us_round_max": _NUM,
    "wire_bytes_measured": _NUM, "check": str,
}
_NULLABLE = {"wire_bytes_measured", "network"}
# None allowed in ckpt and zero records: a row that did not run or has no size
_NULLABLE_ROWS = _NULLABLE | {"size_bytes", "time_s", "gbps", "peak_mib_per_rank", "x_model"}
DEVICES = ("cpu", "cuda")

# bench train: one record per peer (op "step") ...
TRAIN_FIELDS = {
    "bench": str, "op": str, "peer": str, "ranks": int, "hosts": int, "model": str,
    "params": int, "grad_bytes": int, "batch": int, "steps": int, "rounds": int,
    "step_ms": _NUM, "step_ms_min": _NUM, "step_ms_max": _NUM, "step_ms_rounds": list,
    "samples_per_s": _NUM, "loss": _NUM, "backward_ms": _NUM, "comm_ms": _NUM,
    "backward_comm_ms": _NUM, "overlap_ms": _NUM, "wrong": int,
}
# ... with --parts, the FSDP2 step split (bench.train_parts), checked when present ...
TRAIN_PARTS_FIELDS = {"compute_ms": _NUM, "coll_ms": _NUM, "pack_ms": _NUM, "wire_ms": _NUM,
                      "unpack_ms": _NUM}
# ... and one per optimizer of --curve (op "curve").
CURVE_FIELDS = {
    "bench": str, "op": str, "peer": str, "ranks": int, "hosts": int, "model": str,
    "steps": int, "losses": list, "wrong": int,
}
# bench compressed --crossover: one record per setting and 1-bit API (op "crossover"; a
# crossover_bytes of None: 1-bit never faster).
CROSSOVER_FIELDS = {"setting": str, "onebit_op": str, "api": str, "sizes": list, "fp32_us": list,
                    "onebit_us": list, "crossover_bytes": int}
_SIGNED = {"overlap_ms", "hidden_pct"}  # may be negative: communication slowed the backward down

# bench ckpt: one record per timed operation (time_s None: not run; size_bytes None: unknown).
CKPT_FIELDS = {"size_bytes": int, "time_s": _NUM, "gbps": _NUM, "note": str}
# bench zero: one record per row of each part (op "time", "memory" or "bytes").
ZERO_FIELDS = {
    "time": {"peer": str, "params": int, "steps": int, "backward_ms": _NUM, "wait_ms": _NUM,
             "opt_step_ms": _NUM, "step_ms": _NUM, "x_ddp_gloo": _NUM, "bwd_alone_ms": _NUM,
             "comm_alone_ms": _NUM, "sum_ms": _NUM, "overlapped_ms": _NUM, "hidden_pct": _NUM},
    "memory": {"peer": str, "params": int, "model_mib": _NUM, "peak_mib_per_rank": list,
               "x_model": _NUM, "note": str},
    "bytes": {"peer": str, "params": int, "bytes_per_step": _NUM, "x_model": _NUM,
              "by_call": dict},
}


def median_round(rounds: Sequence[Sequence[float]]) -> tuple[tuple[float, float, float], list[float]]:
    """Of interleaved rounds of ``(min, mean, max)`` seconds over ranks: the median round (by its
    mean; the lower one of an even count, so it is a real round) and every round's mean."""
    if not rounds:
        raise ValueError("median_round: expected at least one round, got none")
    means = [float(r[1]) for r in rounds]
    order = sorted(range(len(rounds)), key=means.__getitem__)
    mid = rounds[order[(len(rounds) - 1) // 2]]
    return (float(mid[0]), float(mid[1]), float(mid[2])), means


def make_record(*, bench: str, op: str, dtype: str, size_bytes: int, info: dict,
                times_s: Sequence[float], algbw_gbps: float, busbw_gbps: float,
                wire_bytes: int, wrong: int, round_means_s: Sequence[float] | None = None,
                **extra) -> dict:
    """Build one measurement record (times in seconds in, microseconds out).

    ``times_s`` is ``(min, mean, max)`` over ranks (of the median round); ``round_means_s``, when
    the size was measured in rounds, is each round's mean and adds the round fields.
    """
    tmin, tmean, tmax = times_s
    rec = {
        "bench": bench, "op": op, "dtype": dtype, "size_bytes": int(size_bytes),
        "ranks": int(info["ranks"]), "hosts": int(info["hosts"]),
        "time_us_min": tmin * 1e6, "time_us_mean": tmean * 1e6, "time_us_max": tmax * 1e6,
        "algbw_gbps": float(algbw_gbps), "busbw_gbps": float(busbw_gbps),
        "wire_bytes": int(wire_bytes), "wrong": int(wrong), "network": info.get("network"),
    }
    if round_means_s is not None:
        us = [t * 1e6 for t in round_means_s]
        rec.update(rounds=len(us), time_us_rounds=us, time_us_round_min=min(us),
                   time_us_round_max=max(us))
    rec.update(extra)
    return rec


def _type_ok(value, kind) -> bool:
    if isinstance(value, bool):
        return False
    if kind is _NUM:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _check_fields(rec: dict, fields: dict, required: bool, problems: list[str],
                  nullable: set = _NULLABLE) -> None:
    for name, kind in fields.items():
        if name not in rec:
            if required:
                problems.append(f"missing field {name!r}")
            continue
        value = rec[name]
        if value is None and name in nullable:
            continue
        if not _type_ok(value, kind):
            expected = "number" if kind is _NUM else kind.__name__
            problems.append(f"field {name!r}: expected {expected}, got {type(value).__name__} "
                            f"{value!r}")
        elif kind in (int, _NUM) and value < 0 and name not in _SIGNED:
            problems.append(f"field {name!r}: expected >= 0, got {value!r}")


def _ordered(rec: dict, lo: str, mid: str, hi: str, problems: list[str]) -> None:
    values = [rec.get(k) for k in (lo, mid, hi)]
    if all(_type_ok(v, _NUM) for v in values) and not (
            values[0] <= values[1] * (1 + 1e-9) and values[1] <= values[2] * (1 + 1e-9)):
        problems.append(f"expected {lo} <= {mid} <= {hi}, got {values[0]!r}, {values[1]!r}, "
                        f"{values[2]!r}")


def _check_rounds(rec: dict, list_name: str, count_name: str, lo: str, hi: str,
                  problems: list[str]) -> None:
    series = rec.get(list_name)
    if not isinstance(series, list):
        return
    if not series or not all(_type_ok(v, _NUM) and v >= 0 for v in series):
        problems.append(f"field {list_name!r}: expected a non-empty list of numbers >= 0, "
                        f"got {series!r}")
        return
    if count_name in rec and rec[count_name] != len(series):
        problems.append(f"field {list_name!r}: expected {count_name} = {rec[count_name]!r} "
                        f"values, got {len(series)}")
    for name, want in ((lo, min(series)), (hi, max(series))):
        if name in rec and _type_ok(rec[name], _NUM) and not math.isclose(rec[name], want,
                                                                           rel_tol=1e-9):
            problems.append(f"field {name!r}: expected {want!r} (of {list_name}), got {rec[name]!r}")


def validate_record(rec: dict) -> list[str]:
    """Return the problems of one record (missing fields, wrong types or order); empty when valid."""
    problems: list[str] = []
    if not isinstance(rec, dict):
        return [f"expected a record dict, got {type(rec).__name__}"]
    _check_fields(rec, ENVELOPE_FIELDS, True, problems)
    if rec.get("bench") == "ckpt":
        _check_fields(rec, CKPT_FIELDS, True, problems, _NULLABLE_ROWS)
        return problems
    if rec.get("bench") == "zero":
        fields = ZERO_FIELDS.get(rec.get("op"))
        if fields is None:
            return problems + [f"field 'op': expected one of {sorted(ZERO_FIELDS)} for bench zero, "
                               f"got {rec.get('op')!r}"]
        _check_fields(rec, fields, True, problems, _NULLABLE_ROWS)
        return problems
    if rec.get("op") == "crossover":
        _check_fields(rec, CROSSOVER_FIELDS, True, problems, {"crossover_bytes"})
        sizes = rec.get("sizes")
        if isinstance(sizes, list) and not (len(sizes) == len(rec.get("fp32_us") or ())
                                            == len(rec.get("onebit_us") or ())):
            problems.append("fields 'sizes', 'fp32_us', 'onebit_us': expected lists of one length")
        return problems
    if rec.get("bench") == "train":
        curve = rec.get("op") == "curve"
        _check_fields(rec, CURVE_FIELDS if curve else TRAIN_FIELDS, True, problems)
        if curve:
            losses = rec.get("losses")
            if isinstance(losses, list) and len(losses) != rec.get("steps"):
                problems.append(f"field 'losses': expected steps = {rec.get('steps')!r} values, "
                                f"got {len(losses)}")
        else:
            _check_fields(rec, TRAIN_PARTS_FIELDS, False, problems)
            _ordered(rec, "step_ms_min", "step_ms", "step_ms_max", problems)
            _check_rounds(rec, "step_ms_rounds", "rounds", "step_ms_min", "step_ms_max", problems)
        return problems
    _check_fields(rec, RECORD_FIELDS, True, problems)
    _check_fields(rec, OPTIONAL_FIELDS, False, problems)
    _ordered(rec, "time_us_min", "time_us_mean", "time_us_max", problems)
    if "time_us_rounds" in rec:
        missing = [k for k in ("rounds", "time_us_round_min", "time_us_round_max") if k not in rec]
        if missing:
            problems.append(f"field 'time_us_rounds' given without {', '.join(missing)}")
        _ordered(rec, "time_us_round_min", "time_us_mean", "time_us_round_max", problems)
        _check_rounds(rec, "time_us_rounds", "rounds", "time_us_round_min", "time_us_round_max",
                      problems)
    if "device" in rec and rec["device"] not in DEVICES:
        problems.append(f"field 'device': expected one of {DEVICES}, got {rec['device']!r}")
    return problems
