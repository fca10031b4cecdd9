"""Small one-rank checkpoints for the ckpt failure tests: a model, a save with Adam state, the
command line run in this process."""
from __future__ import annotations

import torch
from mpi4py import MPI

import ckpt
import mpicomm
from ckpt import cli as ckpt_cli
from zero import ZeroOptimizer


def make_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def self_comm():
    return mpicomm.as_communicator(MPI.COMM_SELF)


def save_small(path, seed=0, step=1, **kw):
    """A one-rank save (in this process) of a small model with Adam state."""
    model = make_model(seed)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=self_comm(), lr=0.01)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    m = ckpt.save(path, model=model, optimizer=opt, step=step, comm=MPI.COMM_SELF, **kw)
    return model, m


def cli(*args: str, capsys=None) -> tuple[int, str, str]:
    """``python -m ckpt ARGS`` in this process: (exit code, stdout, stderr)."""
    code = ckpt_cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
