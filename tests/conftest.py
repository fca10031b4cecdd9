"""Shared pytest set-up: report header, abort-on-failure for multi-rank runs, common fixtures."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

_WORLD = MPI.COMM_WORLD

#: A test that runs in a one-process run only (skipped under mpiexec): ``from conftest import single_process``.
single_process = pytest.mark.skipif(_WORLD.Get_size() > 1, reason="single-process test")


def pytest_report_header(config):
    import mpi4py
    import numpy
    import torch

    from accelerators.mpi_lib import library_version

    vendor, vver = MPI.get_vendor()
    lib = library_version().splitlines()[0].strip()
    return [
        f"MPI: {vendor} {'.'.join(map(str, vver))} (standard {'.'.join(map(str, MPI.Get_version()))}; {lib})",
        f"mpi4py {mpi4py.__version__}, torch {torch.__version__}, numpy {numpy.__version__}",
        f"rank {_WORLD.Get_rank()} of {_WORLD.Get_size()}",
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a multi-rank run, a failure on any rank aborts the whole job instead of hanging it."""
    outcome = yield
    report = outcome.get_result()
    if _WORLD.Get_size() > 1 and report.failed and not os.environ.get("MPICOMM_TEST_NO_ABORT"):
        rank = _WORLD.Get_rank()
        sys.stderr.write(
            f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}); aborting the MPI job\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()
        time.sleep(0.5)  # let other ranks that failed together print their reports too
        _WORLD.Abort(1)


@pytest.fixture(scope="session")
def world():
    """The raw mpi4py world communicator."""
    return _WORLD


@pytest.fixture(scope="session")
def comm():
    """The mpicomm world communicator."""
    import mpicomm

    return mpicomm.init()


@pytest.fixture
def shared_tmp_path(tmp_path_factory, request) -> Path:
    """A fresh directory, the same path on every rank of the world communicator."""
    path = None
    if _WORLD.Get_rank() == 0:
        path = str(tmp_path_factory.mktemp(request.node.name[:40].replace("/", "_")))
    path = _WORLD.bcast(path, root=0)
    return Path(path)


@pytest.fixture(scope="module")
def device():
    """This rank's GPU for the GPU tests (ranks share GPUs round-robin when there are fewer GPUs
    than ranks); made current with ``torch.cuda.set_device``."""
    import torch

    idx = _WORLD.Get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: the thread pool only costs time on a loaded
    machine. Opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def native_facts():
    """(module, why): the compiled remembered-call check of ``mpicomm.native``, built once by
    rank 0 into ``build/native-cache`` (or ``MPICOMM_NATIVE_CACHE``) and loaded on every rank;
    (None, reason) where any rank has no compiler, headers or module."""
    from mpicomm import native

    cache = None if os.environ.get(native.CACHE_VAR) else (
        Path(__file__).resolve().parent.parent / "build" / "native-cache")
    why = None
    if _WORLD.Get_rank() == 0:
        try:
            native.build(cache)
        except RuntimeError as exc:
            why = str(exc).splitlines()[0]
    why = _WORLD.bcast(why, root=0)
    module = None if why else native.load(cache)
    if _WORLD.allreduce(module is not None, op=MPI.LAND):
        return module, None
    return None, why or "mpicomm.native: built, but it did not load on every rank"


@pytest.fixture(params=["python", "native"])
def facts_reader(request, monkeypatch, native_facts):
    """The test once with mpicomm.fastpath's remembered-call check in Python, once in C."""
    from mpicomm import fastpath

    module, why = native_facts
    if request.param == "native" and module is None:
        pytest.skip(why)
    monkeypatch.setattr(fastpath, "_same", None if module is None or request.param == "python"
                        else module.same)
    monkeypatch.setattr(fastpath, "_same2", None if module is None or request.param == "python"
                        else module.same2)
    return request.param
