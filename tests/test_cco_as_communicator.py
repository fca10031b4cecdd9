"""mpicomm.as_communicator: the one way every comm= parameter becomes a Communicator."""
import pytest
from mpi4py import MPI

import mpicomm


def test_none_and_comm_world_are_the_world():
    world = mpicomm.init()
    assert mpicomm.as_communicator(None) is world
    assert mpicomm.as_communicator(MPI.COMM_WORLD) is world
    assert mpicomm.as_communicator(world) is world


def test_an_mpi4py_intracommunicator_is_wrapped():
    dup = MPI.COMM_WORLD.Dup()
    try:
        comm = mpicomm.as_communicator(dup)
        assert isinstance(comm, mpicomm.Communicator)
        assert comm.mpi_comm is dup
        assert (comm.rank, comm.size) == (dup.Get_rank(), dup.Get_size())
    finally:
        dup.Free()


@pytest.mark.parametrize("bad", [0, "world", MPI.COMM_NULL, object()])
def test_anything_else_is_a_type_error_naming_what_arrived(bad):
    with pytest.raises(TypeError, match=r"comm: expected None .*got " + type(bad).__name__):
        mpicomm.as_communicator(bad)
