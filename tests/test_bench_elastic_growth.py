"""bench elastic --growth: a growth record split into its parts, and which rank's records count
(no MPI)."""
from __future__ import annotations

import pytest

from bench import elastic_growth

pytestmark = pytest.mark.once    # pure: CI runs it on MPICH only


def test_split_gives_spawn_start_up_join_and_the_whole():
    g = {"spawn_s": 0.12, "ready_s": 4.62, "grow_s": 4.70, "note": None}
    spawn, start, join, whole = elastic_growth.split(g)
    assert spawn == pytest.approx(0.12)
    assert start == pytest.approx(4.50)     # the spawn to the ready message
    assert join == pytest.approx(0.08)      # the ready message to the first commit at full size
    assert whole == pytest.approx(spawn + start + join)


def test_growths_come_from_an_original_rank_not_a_replacement():
    old = {"growths": [{"grow_s": 5.0}], "newcomer": False}
    new = {"growths": [], "newcomer": True}     # it saw no growth: it was the growth
    assert elastic_growth.growths({"ranks": {0: new, 1: old}}) == [{"grow_s": 5.0}]
    assert elastic_growth.growths({"ranks": {0: new}}) == []
    assert elastic_growth.growths({"ranks": {}}) == []


def test_floor_runs_a_fresh_interpreter_and_reads_its_two_timings():
    whole, torch_s, adam_s = elastic_growth.floor()
    assert 0 < torch_s < whole and 0 <= adam_s < whole
    assert torch_s + adam_s <= whole
