"""Local rank detection with fake environments and a fake shared-memory split."""
from __future__ import annotations

import itertools

import pytest

from accelerators import LocalRank, detect_local_rank

# The priority order the issue asks for, written out independently of the code's table.
LAUNCHERS = [
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
    ("PALS_LOCAL_RANKID", None),
    ("SLURM_LOCALID", None),
]


class FakeSplit:
    """Stands in for Split_type(COMM_TYPE_SHARED); counts calls."""

    def __init__(self, rank=0, size=1, error=None):
        self.rank, self.size, self.error, self.calls = rank, size, error, 0

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.rank, self.size


@pytest.mark.parametrize("rank_var,size_var", LAUNCHERS)
def test_each_launcher_variable_alone(rank_var, size_var):
    env = {rank_var: "3"}
    if size_var:
        env[size_var] = "8"
    split = FakeSplit(rank=0, size=99)
    got = detect_local_rank(env=env, shared_split=split)
    assert (got.rank, got.source, got.warnings) == (3, rank_var, ())
    if size_var:
        assert got.size == 8
    assert split.calls == 0, "MPI split must not run when a launcher variable answers"


@pytest.mark.parametrize("hi,lo", list(itertools.combinations(range(len(LAUNCHERS)), 2)))
def test_priority_between_launchers(hi, lo):
    env = {LAUNCHERS[hi][0]: "1", LAUNCHERS[lo][0]: "2"}
    got = detect_local_rank(env=env, shared_split=None)
    assert (got.rank, got.source) == (1, LAUNCHERS[hi][0])
    assert len(got.warnings) == 1 and LAUNCHERS[lo][0] in got.warnings[0]


def test_mpirun_inside_sbatch_prefers_mpi_variable_and_warns():
    # sbatch gives every task of the batch step SLURM_LOCALID=0; mpirun's own variable is right.
    env = {"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    got = detect_local_rank(env=env, shared_split=None)
    assert (got.rank, got.size, got.source) == (1, 2, "MPI_LOCALRANKID")
    assert any("SLURM_LOCALID says local rank 0" in w for w in got.warnings)


def test_agreeing_sources_give_no_warning():
    env = {"SLURM_LOCALID": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert detect_local_rank(env=env, shared_split=None).warnings == ()


def test_explicit_wins_and_disagreement_is_reported():
    got = detect_local_rank(explicit=2, env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"},
                            shared_split=None)
    assert (got.rank, got.source) == (2, "explicit")
    assert got.size is None  # the size came from a source that disagrees on the rank
    assert any("MPI_LOCALRANKID says local rank 0" in w for w in got.warnings)


def test_explicit_takes_size_from_an_agreeing_source():
    got = detect_local_rank(explicit=1, env={"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
                            shared_split=None)
    assert (got.rank, got.size, got.warnings) == (1, 4, ())


def test_override_variable_beats_launchers():
    got = detect_local_rank(env={"MPICOMM_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "5"},
                            shared_split=None)
    assert (got.rank, got.source, got.warnings) == (5, "MPICOMM_LOCAL_RANK", ())


@pytest.mark.parametrize("bad", ["-1", "one", "1.5"])
def test_bad_override_variable_is_an_error(bad):
    with pytest.raises(ValueError, match="MPICOMM_LOCAL_RANK.*expected an integer >= 0"):
        detect_local_rank(env={"MPICOMM_LOCAL_RANK": bad}, shared_split=None)


@pytest.mark.parametrize("bad", [-1, "1", True, 1.0])
def test_bad_explicit_value_is_an_error(bad):
    with pytest.raises(ValueError, match="explicit local rank"):
        detect_local_rank(explicit=bad, env={}, shared_split=None)


def test_garbage_launcher_variable_is_skipped_with_a_warning():
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "x", "SLURM_LOCALID": "3"}
    got = detect_local_rank(env=env, shared_split=None)
    assert (got.rank, got.source) == (3, "SLURM_LOCALID")
    assert any("ignored OMPI_COMM_WORLD_LOCAL_RANK='x'" in w for w in got.warnings)


def test_unparsable_size_is_dropped():
    got = detect_local_rank(env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2(x3)"},
                            shared_split=None)
    assert (got.rank, got.size) == (0, None)


def test_rank_not_below_size_is_reported():
    got = detect_local_rank(env={"MPI_LOCALRANKID": "4", "MPI_LOCALNRANKS": "4"},
                            shared_split=None)
    assert got.rank == 4 and any("not below the local size 4" in w for w in got.warnings)


def test_mpi_split_is_the_fallback():
    split = FakeSplit(rank=1, size=3)
    got = detect_local_rank(env={}, shared_split=split)
    assert (got.rank, got.size, got.source, got.warnings) == (
        1, 3, "MPI Split_type(COMM_TYPE_SHARED)", ())
    assert split.calls == 1


def test_cross_check_fills_size_and_accepts_another_numbering():
    agree = detect_local_rank(env={"SLURM_LOCALID": "1"}, shared_split=FakeSplit(1, 2),
                              cross_check=True)
    assert (agree.rank, agree.size, agree.source, agree.warnings) == (1, 2, "SLURM_LOCALID", ())
    # Open MPI's by-core mapping numbers a node's ranks 0, 2, 1, 3 where the split (world-rank
    # order) says 0, 1, 2, 3: the launcher wins and that is no disagreement.
    other = detect_local_rank(env={"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, shared_split=FakeSplit(1, 4),
                              cross_check=True)
    assert (other.rank, other.size, other.source, other.warnings) == (
        2, 4, "OMPI_COMM_WORLD_LOCAL_RANK", ())


def test_cross_check_reports_a_different_node_size():
    got = detect_local_rank(env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"},
                            shared_split=FakeSplit(0, 2), cross_check=True)
    assert got.rank == 0 and got.size == 4
    assert any("4 ranks on this node" in w and "counts 2" in w for w in got.warnings), got.warnings


@pytest.mark.parametrize("ranks,ok", [([0, 2, 1, 3], True), ([0], True), ([1, 0], True),
                                      ([0, 0], False), ([1, 2], False), ([0, 1, 3], False)])
def test_numbering_problem(ranks, ok):
    from accelerators.local_rank import numbering_problem

    problem = numbering_problem(ranks, "X")
    assert (problem is None) == ok
    if not ok:
        assert str(ranks) in problem and "X" in problem


def test_failing_split_falls_back_to_zero_and_says_why():
    got = detect_local_rank(env={}, shared_split=FakeSplit(error=RuntimeError("no MPI here")))
    assert (got.rank, got.size, got.source) == (0, None, "default")
    assert any("no MPI here" in w for w in got.warnings)


def test_no_source_at_all():
    got = detect_local_rank(env={}, shared_split=None)
    assert (got.rank, got.source) == (0, "default") and got.warnings


@pytest.mark.parametrize("rank,count,expected", [(0, 1, 0), (5, 4, 1), (3, 8, 3), (7, 2, 1)])
def test_device_index_is_local_rank_modulo_devices(rank, count, expected):
    assert LocalRank(rank, None, "test").device_index(count) == expected


def test_device_index_needs_a_device():
    with pytest.raises(ValueError, match="device_count must be >= 1, got 0"):
        LocalRank(0, None, "test").device_index(0)


def test_local_rank_is_frozen():
    with pytest.raises(AttributeError):
        LocalRank(0, 1, "test").rank = 1


def test_zero_local_size_is_ignored():
    got = detect_local_rank(env={"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "0"}, shared_split=None)
    assert (got.rank, got.size, got.warnings) == (0, None, ())
