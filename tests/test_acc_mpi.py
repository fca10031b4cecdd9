"""Accelerator detection under a real MPI launch, checked against MPI's own shared-memory split."""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI
from mpitest import assert_all, check_all

from accelerators import detect_local_rank, get_accelerator
from accelerators.__main__ import main
from accelerators.diagnose import collect


def _node_rank_and_size(world):
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


@pytest.mark.mpi(min_size=1)
def test_local_rank_agrees_with_the_communicator_and_the_node(world):
    import mpicomm

    node_rank, node_size = _node_rank_and_size(world)
    got = detect_local_rank(cross_check=True)
    comm_local = mpicomm.as_communicator(world).local_rank
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        on_node = node.allgather(got.rank)
    finally:
        node.Free()

    def check():
        # Any numbering the launcher chooses (Open MPI's by-core mapping: world 0-3 -> 0, 2, 1, 3)
        # is fine as long as everyone agrees and each of 0..n-1 is used once per node.
        assert comm_local == got.rank == get_accelerator().local_rank().rank, (
            f"Communicator says {comm_local}, accelerators {got} / {get_accelerator().local_rank()}")
        assert sorted(on_node) == list(range(node_size)), f"local ranks on the node: {on_node}"
        assert got.size in (None, node_size), f"{got} but the node has {node_size} ranks"
        assert got.warnings == (), got.warnings
        if got.source == "MPI Split_type(COMM_TYPE_SHARED)":
            assert got.rank == node_rank

    check_all(check, world)


@pytest.mark.mpi(min_size=1)
def test_local_ranks_are_distinct_per_host(world):
    acc = get_accelerator()
    pairs = world.allgather((MPI.Get_processor_name(), acc.local_rank().rank))
    by_host = {}
    for host, rank in pairs:
        by_host.setdefault(host, []).append(rank)
    bad = {h: r for h, r in by_host.items() if sorted(r) != list(range(len(r)))}
    assert_all(not bad, f"local ranks per host are not 0..n-1: {bad}", world)
    index = acc.local_device_index()
    assert_all(0 <= index < max(1, acc.device_count()), f"device index {index}", world)


@pytest.mark.mpi(min_size=1)
def test_diagnosis_is_collective_and_consistent(world):
    report = collect()
    reports = world.allgather(report)
    import mpicomm

    expected_rank = mpicomm.as_communicator(world).local_rank

    def check():
        assert report["rank"] == world.Get_rank() and report["size"] == world.Get_size()
        assert report["local_rank"] == expected_rank, report
        assert report["cuda_aware"] in ("yes", "no", "unknown")
        assert len({r["cuda_aware"] for r in reports}) == 1, [r["cuda_aware"] for r in reports]
        assert len({r["accelerator"] for r in reports}) == 1
        assert report["mpi"]["vendor"] == "{} {}".format(
            MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1])))

    check_all(check, world)


@pytest.mark.mpi(min_size=1)
def test_main_prints_every_rank_from_rank_0(world, capsys):
    rc = main(["--json"])
    out = capsys.readouterr().out

    def check():
        assert rc == 0
        if world.Get_rank() == 0:
            reports = json.loads(out)
            assert [r["rank"] for r in reports] == list(range(world.Get_size()))
        else:
            assert out == ""

    check_all(check, world)
    rc = main([])
    text = capsys.readouterr().out
    if world.Get_rank() == 0:
        assert_all(all(f"rank {r} of {world.Get_size()}" in text
                       for r in range(world.Get_size())), text, world)
    else:
        assert_all(text == "", text, world)
