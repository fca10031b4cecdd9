"""bench elastic --peers: the figures it prints, from a run's events (no MPI, no peers)."""
from __future__ import annotations

import math

import pytest

from bench import elastic_peers

pytestmark = pytest.mark.once    # pure: CI runs it on MPICH only


def _step(rank, step, t0, t1, world, counted=True, ft=0.1):
    return {"ev": "step", "rank": rank, "step": step, "t0": t0, "t1": t1, "ft_s": ft, "counted": counted,
            "world": world}


def test_measure_reads_detection_recovery_and_the_return_to_full_size():
    evs = [_step(r, s, 1.0 * s, 1.0 * s + 0.9, 4) for r in range(4) for s in (1, 2)]
    evs += [{"ev": "death", "t": 3.0, "rank": 1},
            {"ev": "failed", "t": 3.5, "at": 3.2, "rank": 0},
            _step(0, 3, 2.99, 3.3, 4, counted=False),         # started before the death: not a recovery
            _step(0, 3, 3.6, 4.1, 3), _step(2, 3, 3.6, 4.0, 3),
            _step(0, 4, 4.2, 4.9, 4), _step(7, 4, 4.2, 4.8, 4)]
    m = elastic_peers.measure(sorted(evs, key=lambda e: e.get("t", e.get("t0"))), kill_step=3)
    assert m["detect_s"] == pytest.approx(0.2)              # the survivor's recovery began at 3.2
    assert m["recover_s"] == pytest.approx(1.0)             # the first counted step after it ended at 4.0
    assert m["full_s"] == pytest.approx(1.8)                # the first step at 4 workers ended at 4.8
    assert m["world_after"] == 3
    assert m["step_s"] == pytest.approx(0.8) and m["ft_s"] == pytest.approx(0.1)


def test_measure_without_a_return_to_full_size():
    evs = [_step(r, 1, 1.0, 1.9, 4) for r in range(4)]
    evs += [{"ev": "death", "t": 2.0, "rank": 1}, _step(0, 2, 2.1, 2.6, 3)]
    m = elastic_peers.measure(evs, kill_step=2)
    assert math.isnan(m["detect_s"]) and math.isnan(m["full_s"])
    assert m["recover_s"] == pytest.approx(0.6)
