"""One failure path for every ckpt entry point: a step that fails on any rank raises the same
exception on every rank (never a hang), every checkpoint error is a CheckpointError whose
``exit_code`` the CLI returns, and ``to_deepspeed_universal`` without ``comm`` shares the work
over the world."""
from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
from mpi4py import MPI

import ckpt
import ckpt.deepspeed
from ckpt import cli as ckpt_cli
from ckpt import errors
from ckpt.collective import Collective
from mpitest import assert_all


class Unpicklable(Exception):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def _raise(exc: BaseException):
    raise exc


def _same_on_every_rank(world, exc) -> tuple[str, str]:
    seen = world.allgather((type(exc).__qualname__, str(exc)))
    assert_all(len(set(seen)) == 1, f"ranks raised different exceptions: {seen}")
    return seen[0]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_failure_on_root_raises_everywhere_even_unpicklable(comm, world):
    run = Collective(comm, "demo")
    for exc in (Unpicklable("lock inside (simulated)"), ckpt.ChecksumError("bad block 3 (simulated)"),
                BadStr()):
        caught = None
        try:
            run.on_root("step", lambda e=exc: _raise(e) if world.Get_rank() == 0 else None)
        except Exception as got:  # noqa: BLE001
            caught = got
        assert_all(caught is not None, "no exception")
        if world.Get_size() == 1:
            assert caught is exc  # one process: the step's own exception, unchanged
            continue
        name, text = _same_on_every_rank(world, caught)
        assert_all(text.startswith("demo (step) failed on rank 0 of"), text)
        assert_all(caught.failures[0].rank == 0 and caught.failures[0].type_name == type(exc).__name__, text)
        if isinstance(exc, ckpt.ChecksumError):  # a ckpt class is rebuilt as itself, exit code included
            assert_all(type(caught) is ckpt.ChecksumError and caught.exit_code == errors.EXIT_DAMAGED, name)
        else:
            assert_all(isinstance(caught, ckpt.StepFailedError) and caught.exit_code == errors.EXIT_FAILED, name)
        if isinstance(exc, BadStr):
            assert_all("unprintable" in text, text)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_unsendable_result_on_root_raises_everywhere(comm, world):
    run = Collective(comm, "demo")
    caught = None
    try:
        run.on_root("step", lambda: threading.Lock())
    except Exception as got:  # noqa: BLE001
        caught = got
    if world.Get_size() == 1:
        assert caught is None  # nothing to send
        return
    _same_on_every_rank(world, caught)
    assert_all(isinstance(caught, TypeError) and isinstance(caught, ckpt.StepFailedError), repr(caught))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_failures_on_several_ranks_are_all_reported(comm, world):
    run = Collective(comm, "demo")
    size = world.Get_size()
    caught = None
    try:
        run.everywhere("step", lambda: _raise(OSError(f"disk {world.Get_rank()} full")) if world.Get_rank() else 7)
    except Exception as got:  # noqa: BLE001
        caught = got
    _name, text = _same_on_every_rank(world, caught)
    assert_all(isinstance(caught, OSError) and isinstance(caught, ckpt.CheckpointError), repr(caught))
    head = "demo (step) failed on " + ("rank 1 of 2" if size == 2 else f"{size - 1} of {size} ranks")
    assert_all(text.startswith(head), text)
    assert_all([(f.rank, f.type_name, f.message) for f in caught.failures]
               == [(r, "OSError", f"disk {r} full") for r in range(1, size)], text)
    assert_all(all(f"OSError: disk {r} full" in text for r in range(1, size)), text)
    assert_all(run.everywhere("step", lambda: world.Get_rank()) == world.Get_rank())


def _ckpt_exception_classes() -> list[type]:
    found = set()
    for mod in (ckpt, ckpt.deepspeed, errors):
        for _name, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("ckpt"):
                found.add(obj)
    return sorted(found, key=lambda c: c.__name__)


def test_every_ckpt_exception_is_a_checkpoint_error_with_a_documented_exit_code():
    classes = _ckpt_exception_classes()
    assert len(classes) >= 10, classes
    codes = {errors.EXIT_DAMAGED, errors.EXIT_USAGE, errors.EXIT_INCOMPLETE, errors.EXIT_PICKLE,
             errors.EXIT_EXISTS, errors.EXIT_FAILED}
    for cls in classes:
        assert issubclass(cls, ckpt.CheckpointError), cls
        assert cls.exit_code in codes, (cls, cls.exit_code)
    # the mix-ins callers rely on
    assert issubclass(ckpt.ManifestError, ValueError) and issubclass(ckpt.StateMismatchError, KeyError)
    assert issubclass(ckpt.CheckpointExistsError, FileExistsError)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError):
        ckpt.NoSuchName  # noqa: B018


@pytest.mark.parametrize("cls", _ckpt_exception_classes(), ids=lambda c: c.__name__)
def test_cli_exit_code_is_the_exceptions(monkeypatch, capsys, cls, tmp_path):
    monkeypatch.setattr(ckpt_cli, "read_manifest", lambda path: _raise(cls("simulated problem")))
    code = ckpt_cli.main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == cls.exit_code and "simulated problem" in err, (code, err)


# -- to_deepspeed_universal with comm=None under mpiexec -------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_to_deepspeed_universal_without_comm_shares_the_world(comm, world, shared_tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3),
                                torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
    ckpt.save(shared_tmp_path / "ours", model=model, optimizer=opt, step=2, comm=comm)
    out = ckpt.to_deepspeed_universal(shared_tmp_path / "ours", shared_tmp_path / "uni" / "tag")
    assert_all(out == os.path.abspath(shared_tmp_path / "uni" / "tag"), out)
    world.Barrier()
    for name, p in model.named_parameters():
        for key, want in (("fp32", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                          ("exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            got = torch.load(os.path.join(out, "zero", name, f"{key}.pt"), weights_only=True)["param"]
            assert_all(torch.equal(got, want), f"{name} {key}")
    assert_all((shared_tmp_path / "uni" / "latest_universal").read_text() == "tag")
    # a failure on one rank (here: no optimizer state) raises on every rank, with the same message
    ckpt.save(shared_tmp_path / "bare", model=model, comm=comm)
    caught = None
    try:
        ckpt.to_deepspeed_universal(shared_tmp_path / "bare", shared_tmp_path / "uni2" / "tag")
    except Exception as got:  # noqa: BLE001
        caught = got
    assert_all(isinstance(caught, ckpt.IncompatibleStateError) and "no optimizer state" in str(caught),
               repr(caught))
    if world.Get_size() > 1:
        _same_on_every_rank(world, caught)


class _FailingMPI:
    """An mpi4py communicator stand-in of 2 ranks (rank 0 here) whose every call fails as a dead
    peer makes it fail under ULFM."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def _fail(self, *args, **kwargs):
        raise MPI.Exception(MPI.ERR_PROC_FAILED)

    Reduce = allgather = gather = bcast = _fail


class _Survivor:
    """An mpicomm Communicator stand-in: it turns the failure into the RankFailedError naming rank 1."""

    mpi_comm = _FailingMPI()

    def _surface(self, exc, call):
        import mpicomm

        return mpicomm.RankFailedError(f"{call}: rank 1 failed", (1,), exc.Get_error_class())


@pytest.mark.parametrize("step", ["reduce_xor", "reduce_sum", "allgather", "gather"])
def test_a_failed_peer_in_any_collective_step_raises_rank_failed(step):
    import numpy as np

    import mpicomm
    from mpicomm.faults import is_failure

    if not is_failure(MPI.Exception(MPI.ERR_PROC_FAILED)):
        pytest.skip("this MPI has no distinct MPI_ERR_PROC_FAILED class")
    run = Collective(_Survivor(), "demo")
    arg = np.zeros(4, np.uint32) if step.startswith("reduce") else 1
    with pytest.raises(mpicomm.RankFailedError) as info:
        getattr(run, step)(arg)
    assert info.value.failed_ranks == (1,)
