"""Collective assertions: a failure seen on one rank is raised on every rank, naming each rank's problem."""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI


def assert_all(ok: bool, message: str = "", comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Raise AssertionError on every rank if ``ok`` is false on any rank."""
    results = comm.allgather((bool(ok), "" if ok else str(message)))
    bad = [(r, m) for r, (good, m) in enumerate(results) if not good]
    if bad:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in bad)
        raise AssertionError(f"failed on {len(bad)} of {comm.Get_size()} ranks:\n{lines}")


def check_all(fn: Callable[[], None], comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Run ``fn`` (which asserts) on every rank; if it fails anywhere, fail everywhere."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported collectively below
        assert_all(False, f"{type(exc).__name__}: {exc}", comm)
    else:
        assert_all(True, "", comm)


def assert_close_all(actual, expected, *, rtol: float = 0.0, atol: float = 0.0,
                     comm: MPI.Comm = MPI.COMM_WORLD, what: str = "") -> None:
    """Collective ``numpy.testing.assert_allclose`` (exact by default)."""

    def _check():
        a = _as_numpy(actual)
        e = _as_numpy(expected)
        assert a.shape == e.shape, f"{what} shape {a.shape} != expected {e.shape}"
        np.testing.assert_allclose(a.astype(np.float64) if a.dtype.kind in "fc" else a,
                                   e.astype(np.float64) if e.dtype.kind in "fc" else e,
                                   rtol=rtol, atol=atol, err_msg=what)

    check_all(_check, comm)


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the venv's MPI) or on PATH; skip the test if none."""
    import os
    import shutil
    import sys

    import pytest

    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec")
    return found


def mpiexec_cmd(n: int) -> list[str]:
    """Command prefix that starts ``n`` ranks: ``scripts/mpirun.sh`` with :func:`mpiexec_path`.

    The script is the project's one launch logic (Open MPI as root, oversubscription when ranks
    outnumber cores), shared with scripts/test.sh and demo.sh.
    """
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return ["bash", os.path.join(root, "scripts", "mpirun.sh"), "--mpiexec", mpiexec_path(),
            "-n", str(int(n))]


def gloo_init_method(comm: MPI.Comm = MPI.COMM_WORLD) -> str:
    """A tcp:// rendezvous address on this host for a gloo group over ``comm`` (collective)."""
    import socket

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{comm.bcast(port, root=0)}"


def _as_numpy(x) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.dtype == torch.bfloat16:
                x = x.float()
            return x.numpy()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(x, "get"):  # cupy
        return x.get()
    return np.asarray(x)
