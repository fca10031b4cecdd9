"""The MPI rendezvous of env://: torchrun is recognised by what only torchrun sets.

Hugging Face accelerate (and other launchers) export LOCAL_WORLD_SIZE, LOCAL_RANK and the like;
under mpiexec those must not turn the MPI rendezvous off (torch would then ask for MASTER_ADDR).
"""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mpicomm  # noqa: F401 - registers the backend and the env:// fallback
from mpicomm.distributed import _rendezvous
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)

# What torchrun's elastic agent exports in every worker (local_elastic_agent.py, torch 2.13).
TORCHRUN_ONLY = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
# What other launchers export too (accelerate: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
SHARED = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "LOCAL_RANK": "0", "ROLE_RANK": "0",
          "GROUP_WORLD_SIZE": "1"}


@pytest.fixture
def bare_env(monkeypatch):
    """No rendezvous variables and no torchrun variables in the environment."""
    for var in (*TORCHRUN_ONLY, *SHARED, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_variables_other_launchers_set_do_not_mean_torchrun(bare_env):
    for var, value in SHARED.items():
        bare_env.setenv(var, value)
    assert not _rendezvous.under_torchrun()


@pytest.mark.parametrize("var", TORCHRUN_ONLY)
def test_each_variable_only_torchrun_sets_means_torchrun(bare_env, var):
    bare_env.setenv(var, "1")
    assert _rendezvous.under_torchrun()


def _init_and_reduce(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=60))
    try:
        t = torch.full((3,), float(world.rank + 1))
        dist.all_reduce(t)
        assert_all(dist.get_rank() == world.rank and dist.get_world_size() == world.size,
                   f"{dist.get_rank()}/{dist.get_world_size()}")
        assert_close_all(t, np.full(3, world.size * (world.size + 1) / 2))
    finally:
        dist.destroy_process_group()


def test_local_world_size_keeps_the_mpi_rendezvous(bare_env, world):
    """As accelerate leaves the environment: LOCAL_WORLD_SIZE and co., no MASTER_ADDR."""
    bare_env.setenv("LOCAL_WORLD_SIZE", str(world.size))
    bare_env.setenv("LOCAL_RANK", str(world.rank))
    bare_env.setenv("GROUP_RANK", "0")
    _init_and_reduce(world)


def test_launched_by_mpi_with_torchrun_variables_but_no_rendezvous_uses_mpi(bare_env, world):
    """A stale TORCHELASTIC_RUN_ID (say, mpiexec started from a torchrun worker) in an MPI job
    whose rendezvous variables are missing: MPI launched it, so MPI gives the ranks."""
    bare_env.setenv("TORCHELASTIC_RUN_ID", "stale")
    bare_env.setattr(_rendezvous, "under_mpi_launcher", lambda: True)
    _init_and_reduce(world)


def test_under_torchrun_without_mpi_launcher_torch_rendezvous_runs(bare_env):
    """Not started by an MPI launcher, under torchrun: torch's own env:// runs (and says what
    is missing), as it always did."""
    bare_env.setenv("TORCHELASTIC_RUN_ID", "run")
    bare_env.setattr(_rendezvous, "under_mpi_launcher", lambda: False)
    with pytest.raises(ValueError, match="RANK expected, but not set"):
        dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=10))
    assert not dist.is_initialized()
