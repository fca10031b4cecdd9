"""Requests posted by a multi-phase call outlive the call's failure (no MPI needed).

A pending MPI request whose Python object is collected is freed by mpi4py, and MPI may still
write into its buffer; so whatever a call had posted when it failed or was closed is kept.
"""
from __future__ import annotations

import gc
import weakref

import pytest

from mpicomm import requests


class Posted:
    """Stands in for an mpi4py request (something weak-referenceable)."""


def _schedule(fail_after: int):
    posted: list = []
    with requests.kept_on_failure(posted):
        for i in range(3):
            if i == fail_after:
                raise RuntimeError("MPI_ERR_PROC_FAILED (stand-in)")
            posted.append(Posted())
            yield [posted[-1]]


@pytest.mark.parametrize("fail_after", [1, 2])
def test_a_schedule_that_raises_keeps_what_it_posted(fail_after):
    before = len(requests.ABANDONED)
    gen = _schedule(fail_after)
    refs = [weakref.ref(reqs[0]) for reqs in [next(gen) for _ in range(fail_after)]]
    with pytest.raises(RuntimeError):
        next(gen)
    del gen
    gc.collect()
    assert len(requests.ABANDONED) == before + 1
    assert all(r() is not None for r in refs)  # still referenced: never freed
    requests.ABANDONED.pop()


def test_a_schedule_closed_midway_keeps_what_it_posted():
    before = len(requests.ABANDONED)
    gen = _schedule(fail_after=99)
    ref = weakref.ref(next(gen)[0])
    gen.close()  # a call dropped before it finished
    gc.collect()
    assert len(requests.ABANDONED) == before + 1 and ref() is not None
    requests.ABANDONED.pop()


def test_a_schedule_that_completes_keeps_nothing():
    before = len(requests.ABANDONED)
    assert len(list(_schedule(fail_after=99))) == 3
    assert len(requests.ABANDONED) == before
