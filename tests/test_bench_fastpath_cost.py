"""bench.fastpath_cost (one process): every op and case timed, the tensor reads listed, the
check state restored, and a call that did not do its op reported as wrong."""
from __future__ import annotations

import math

import pytest

from bench import fastpath_cost
from conftest import single_process
from mpicomm import fastpath

pytestmark = single_process


def test_rows_for_every_op_and_case(comm):
    before = fastpath._same, fastpath._same2
    result = fastpath_cost.measure(calls=5, rounds=2, comm=comm)
    assert (fastpath._same, fastpath._same2) == before
    cases = {"python", "mpi4py", "mpi4py-spec"} | ({"native"} if fastpath._native else set())
    assert list(result["calls"]) == list(fastpath_cost.OPS)
    for op, row in result["calls"].items():
        assert set(row) == cases, op
        assert all(us > 0 and math.isfinite(us) for us in row.values()), (op, row)
    assert list(result["properties"]) == list(fastpath_cost.PROPERTIES)
    assert result["wrong"] == []


class _NoGather:
    """The communicator, except that all_gather_into_tensor does nothing."""

    def __init__(self, comm) -> None:
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_gather_into_tensor(self, out, x) -> None:
        return None


def test_a_call_that_did_not_do_its_op_is_wrong(comm):
    result = fastpath_cost.measure(calls=2, rounds=1, comm=_NoGather(comm))
    assert result["wrong"] == ["all_gather_into_tensor"]


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="expected calls >= 1 and rounds >= 1, got calls=0"):
        fastpath_cost.measure(calls=0)
