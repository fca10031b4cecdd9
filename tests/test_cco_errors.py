"""Bad input raises before any MPI call; checking mode turns cross-rank mismatches into errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mpicomm
from mpitest import assert_all, check_all, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


@pytest.mark.mpi(min_size=1)
def test_local_errors_name_what_was_expected(comm):
    def checks():
        _raises(ValueError, r"AVG needs a floating dtype", lambda: comm.all_reduce(torch.ones(3, dtype=torch.int32), op="avg"))
        _raises(ValueError, r"bool", lambda: comm.all_reduce(torch.ones(3, dtype=torch.bool), op="avg"))
        _raises(TypeError, r'argument "op".*expected: one of', lambda: comm.all_reduce(torch.ones(3), op="mean"))
        _raises(TypeError, r'argument "op".*expected: one of', lambda: comm.all_reduce(torch.ones(3), op=["sum"]))
        _raises(TypeError, r'argument "op".*expected: one of',
                lambda: comm.reduce_scatter_tensor(torch.ones(1), torch.ones(comm.size), op=["sum"]))
        _raises(TypeError, r"unexpected dtype.*complex64", lambda: comm.all_reduce(torch.ones(3, dtype=torch.complex64)))
        _raises(TypeError, r"torch.Tensor, numpy.ndarray or cupy.ndarray.*list", lambda: comm.all_reduce([1.0, 2.0]))
        _raises(ValueError, rf"expected: {comm.size} x input_tensor.numel\(\) = {3 * comm.size} elements.*got: {3 * comm.size + 1}",
                lambda: comm.all_gather_into_tensor(torch.empty(3 * comm.size + 1), torch.ones(3)))
        _raises(ValueError, r"dtype torch.float32", lambda: comm.all_gather_into_tensor(torch.empty(3 * comm.size, dtype=torch.float64), torch.ones(3)))
        _raises(ValueError, r"x output.numel", lambda: comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * comm.size + 1)))
        _raises(ValueError, rf"a rank in \[0, {comm.size - 1}\].*got: {comm.size}", lambda: comm.broadcast(torch.ones(2), src=comm.size))
        _raises(ValueError, r"a rank in", lambda: comm.send(torch.ones(2), dst=-1))
        _raises(TypeError, r"an int rank", lambda: comm.gather(torch.ones(2), dst="0"))
        _raises(ValueError, rf"a list of {comm.size} buffers", lambda: comm.all_gather([torch.empty(2)] * (comm.size + 1), torch.ones(2)))
        _raises(ValueError, rf"output.numel\(\) == input.numel\(\), divisible by {comm.size} ranks",
                lambda: comm.all_to_all_single(torch.empty(comm.size + 1), torch.ones(comm.size)))
        if comm.size > 1:  # every count is divisible by 1
            _raises(ValueError, r"divisible by", lambda: comm.all_to_all_single(torch.empty(comm.size + 1), torch.ones(comm.size + 1)))
        _raises(ValueError, r"bitwise ops need an integer or bool dtype.*ReduceOp.BXOR on float32",
                lambda: comm.all_reduce(torch.ones(3), op="bxor"))
        _raises(TypeError, r"float8_e4m3fn only moves.*never reduced",
                lambda: comm.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)))
        _raises(TypeError, r"float8_e5m2 only moves",
                lambda: comm.reduce_scatter_tensor(torch.empty(1).to(torch.float8_e5m2), torch.ones(comm.size).to(torch.float8_e5m2)))
        premul = torch.distributed._make_nccl_premul_sum(2.0)
        _raises(TypeError, r"got: ReduceOp.PREMUL_SUM\)$", lambda: comm.all_reduce(torch.ones(3), op=premul))
        _raises(TypeError, r"got: list \['sum'\]\)$", lambda: comm.reduce(torch.ones(3), op=["sum"]))
        _raises(ValueError, r'"op" \(expected: ReduceOp.SUM with a factor.*got: ReduceOp.MAX\)$',
                lambda: comm.all_reduce(torch.ones(3), op="max", factor=2.0))
        _raises(ValueError, r"ReduceOp.SUM with a factor.*got: ReduceOp.AVG",
                lambda: comm.reduce_scatter_tensor(torch.ones(1), torch.ones(comm.size), op="avg",
                                                   factor=0.5))
        _raises(TypeError, r'"factor" \(expected: None, a number or a one-element tensor, got: str',
                lambda: comm.reduce(torch.ones(3), factor="2"))
        _raises(TypeError, r'"factor".*got: torch float32 of shape \(2,\)',
                lambda: comm.all_reduce(torch.ones(3, dtype=torch.bfloat16), factor=torch.ones(2)))
        _raises(ValueError, r"summing to dim 0", lambda: comm.all_to_all_single(torch.empty(4), torch.ones(4), [1] * comm.size, [5] * comm.size))
        _raises(ValueError, r"tag", lambda: comm.isend(torch.ones(1), dst=0, tag=-5))
        _raises(ValueError, r"byte order", lambda: comm.all_reduce(np.ones(3, dtype=">f8")))
        _raises(TypeError, r"numpy array of dtype", lambda: comm.all_reduce(np.ones(3, dtype=np.complex128)))

    check_all(checks)
    # nothing above reached MPI: the communicator still works and agrees
    x = torch.ones(2)
    comm.all_reduce(x)
    assert_all(x.tolist() == [comm.size] * 2, "communicator unusable after errors")


@pytest.mark.mpi(min_size=2)
def test_checking_mode_reports_every_ranks_arguments(comm):
    checked = mpicomm.Communicator(comm.mpi_comm.Dup(), check=True)
    n = 4 if checked.rank == 0 else 5
    with pytest.raises(mpicomm.CollectiveMismatchError) as info:
        checked.all_reduce(torch.ones(n))
    msg = str(info.value)
    assert_all("all_reduce" in msg and "rank 0: all_reduce(op=ReduceOp.SUM, tensor=float32[4])" in msg
               and "rank 1: all_reduce(op=ReduceOp.SUM, tensor=float32[5])" in msg, msg)
    dtype = torch.float32 if checked.rank == 0 else torch.float64
    with pytest.raises(mpicomm.CollectiveMismatchError, match="float64"):
        checked.broadcast(torch.ones(3, dtype=dtype))
    with pytest.raises(mpicomm.CollectiveMismatchError, match="src="):
        checked.broadcast(torch.ones(3), src=checked.rank % 2)
    with pytest.raises(mpicomm.CollectiveMismatchError, match="op="):
        checked.all_reduce(torch.ones(3), op="max" if checked.rank == 0 else "sum")
    # matching calls go through
    y = torch.ones(3)
    checked.all_reduce(y, op="avg")
    assert_all(y.tolist() == [1.0] * 3, "checked all_reduce wrong")
    checked.free()


def test_checking_mode_from_environment(tmp_path):
    script = tmp_path / "env_check.py"
    script.write_text(textwrap.dedent("""
        import torch, mpicomm
        comm = mpicomm.init()
        assert comm.check
        try:
            comm.all_gather_into_tensor(torch.empty(2 * (3 + comm.rank)), torch.ones(3 + comm.rank))
        except mpicomm.CollectiveMismatchError as exc:
            print("MISMATCH", comm.rank, "float32[4]" in str(exc))
    """))
    env = dict(os.environ, MPICOMM_CHECK="1")
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", str(script)],
                          env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("True") == 2, proc.stdout


def test_bad_check_environment_value(monkeypatch):
    monkeypatch.setenv("MPICOMM_CHECK", "maybe")
    with pytest.raises(ValueError, match="MPICOMM_CHECK"):
        from mpi4py import MPI
        mpicomm.Communicator(MPI.COMM_SELF)
