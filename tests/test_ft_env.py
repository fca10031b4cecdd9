"""mpicomm.ft_env: the launch defaults fault tolerance needs, and the error where MPI started
before they could apply (pure: fake environments, no MPI job)."""
from __future__ import annotations

import pytest

from mpicomm import ft_env

pytestmark = pytest.mark.once


@pytest.fixture(autouse=True)
def _keep_module_state(monkeypatch):
    monkeypatch.setattr(ft_env, "too_late", ft_env.too_late)


def test_under_ft_the_defaults_fill_only_what_the_user_left_unset():
    env = {ft_env.FT_VAR: "1", "OMPI_MCA_fcoll": "vulcan"}
    ft_env.set_launch_defaults(env, started=False)
    assert env["OMPI_MCA_btl"] == "tcp,self" and env["OMPI_MCA_fcoll"] == "vulcan"
    assert ft_env.too_late is None


def test_without_ft_nothing_is_set_or_flagged():
    env = {"PATH": "/bin"}
    ft_env.set_launch_defaults(env, started=True)
    assert env == {"PATH": "/bin"} and ft_env.too_late is None


def test_mpi_started_first_under_ft_with_no_transport_chosen_is_flagged():
    ft_env.set_launch_defaults({ft_env.FT_VAR: "1"}, started=True)
    assert "shared memory" in ft_env.too_late and "Import mpicomm" in ft_env.too_late
    ft_env.set_launch_defaults({ft_env.FT_VAR: "1", "OMPI_MCA_btl": "tcp,self"}, started=True)
    assert ft_env.too_late is None      # the user chose at launch: nothing came too late


def test_mpi_started_reads_mpi4py_only_where_it_was_imported():
    class FakeMPI:
        def __init__(self, up):
            self.up = up

        def Is_initialized(self):  # noqa: N802 - mpi4py's name
            return self.up

    assert not ft_env.mpi_started({})
    assert not ft_env.mpi_started({"mpi4py.MPI": FakeMPI(False)})
    assert ft_env.mpi_started({"mpi4py.MPI": FakeMPI(True)})
