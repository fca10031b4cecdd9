"""bench elastic --soak: the job's step timeline chained from its processes', and the time lost
to failures read from it (no MPI)."""
from __future__ import annotations

import pytest

from bench import elastic_soak

pytestmark = pytest.mark.once    # pure: CI runs it on MPICH only


def test_lost_seconds_splits_the_loss_at_the_kills_from_the_rest():
    # 10 steps/s, bins of 0.5 s (5 steps when nothing is lost), a kill every 4 s, 12 s in all
    steps = {b: 5 for b in range(24)}
    steps[8] = steps[9] = 0          # 4.0-5.0 s: stopped right after the first kill
    steps[10] = 2                    # 5.0-5.5 s: 0.3 s lost, still within 1.5 s of it
    steps[3] = 1                     # 1.5-2.0 s: 0.4 s lost, before any kill
    steps[20] = 9                    # 10.0-10.5 s: faster than the rate, makes up for nothing
    del steps[23]                    # 11.5-12.0 s: no step at all (a bin the rank never wrote)
    timeline = {"bin_s": 0.5, "steps": {str(b): n for b, n in steps.items()}}   # as JSON gives it
    near, rest = elastic_soak.lost_seconds(timeline, 12.0, 10.0, kill_every=4.0, after=1.5)
    assert near == pytest.approx(1.3)
    assert rest == pytest.approx(0.9)


def test_lost_seconds_without_kills_and_a_partial_last_bin():
    timeline = {"bin_s": 1.0, "steps": {"0": 10, "1": 4, "2": 0}}
    near, rest = elastic_soak.lost_seconds(timeline, 2.7, 10.0, kill_every=0.0, after=2.0)
    assert near == 0.0
    assert rest == pytest.approx(0.6)    # bin 2 is not whole inside the 2.7 s window


def test_chain_follows_the_oldest_process_still_training():
    bins = 0.5
    first = {"bin_s": bins, "steps": {"0": 5, "1": 5, "2": 2}}               # died in bin 2
    victim = {"bin_s": bins, "steps": {"0": 4, "1": 5, "2": 3, "4": 5, "5": 5}}     # bin 3: recovering; died in 5
    newcomer = {"bin_s": bins, "steps": {"4": 4, "5": 4, "6": 5, "7": 1}}   # joined in bin 4, outlived them
    short = {"bin_s": bins, "steps": {"1": 6}}                              # never the oldest
    job = elastic_soak.chain([newcomer, first, short, victim])
    # bins 0-5: the victim (from bin 0 as the first, and longer); 6-7: the newcomer
    assert job == {"bin_s": bins, "steps": {"0": 4, "1": 5, "2": 3, "3": 0, "4": 5, "5": 5, "6": 5, "7": 1}}


def test_chain_of_nothing():
    assert elastic_soak.chain([]) == {"bin_s": 0.25, "steps": {}}
