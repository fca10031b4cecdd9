"""The process group's blocking wait (mpicomm.distributed._work) on stand-in operations, no MPI:
a long wait yields the core between tests, a wait past the timeout raises and refuses the group."""
from __future__ import annotations

import datetime
import time

import pytest

from mpicomm.distributed import _work
from mpicomm.distributed._work import MpicommWork, ProcessGroupTimeoutError


class _Operation:
    """Stands in for an mpicomm Work: done from monotonic time ``at`` on; counts its tests."""

    def __init__(self, at: float) -> None:
        self.at, self.tests, self._done = at, 0, False

    def _test(self) -> bool:
        self.tests += 1
        self._done = time.monotonic() >= self.at
        return self._done

    def is_completed(self) -> bool:
        return self._done or self._test()

    def exception(self):
        return None


class _Group:
    """What a work asks of its process group."""

    comm = None
    group_name = "stand-in"
    _broken = None

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def _publish_waiting(self, seq, call) -> None:
        pass

    def _peers_report(self, seq, call) -> str:
        return "Ranks: rank 1: did not arrive."


def _work_on(op: _Operation, group: _Group, timeout_s: float) -> MpicommWork:
    return MpicommWork(group, "all_reduce", 1, [op], (), [], [],
                       datetime.timedelta(seconds=timeout_s))


def test_finished_by_tests_until_done_or_the_time_is_up():
    done = _Operation(at=0.0)
    assert _work.finished_by([done, done], time.monotonic() + 10)
    never = _Operation(at=float("inf"))
    began = time.monotonic()
    assert not _work.finished_by([done, never], began + 0.01)
    assert time.monotonic() - began >= 0.01 and never.tests > 0


def test_a_long_blocking_wait_yields_the_core_between_tests(monkeypatch):
    """Past the spin a waiting call yields the core before each further test (it does not
    sleep: MPI progresses the operation only in its tests), and ends once the operation is
    done, not before."""
    yields = []
    monkeypatch.setattr(_work, "_yield", lambda: yields.append(time.monotonic()))
    began = time.monotonic()
    op = _Operation(at=began + 0.1)
    work = _work_on(op, _Group(), timeout_s=60)
    assert work.wait() and work.is_completed() and op._done
    assert time.monotonic() - began >= 0.1
    assert yields and yields[0] - began >= _work.SPIN_S, "yielded before the spin was over"
    assert op.tests - len(yields) <= op.tests // 2, f"{op.tests} tests, {len(yields)} yields"


def test_a_blocking_wait_past_the_timeout_raises_and_refuses_the_group(monkeypatch):
    monkeypatch.setattr(_work, "_left_pending", [])  # the stand-in stays pending: not reported
    group = _Group()
    began = time.monotonic()
    work = _work_on(_Operation(at=float("inf")), group, timeout_s=0.3)
    with pytest.raises(ProcessGroupTimeoutError, match="timeout of 0.3 s.*rank 1: did not arrive"):
        work.wait()
    assert time.monotonic() - began >= 0.3
    assert group._broken is not None and "after an earlier timeout" in group._broken
    assert len(_work._left_pending) == 1
