"""An MPI job killed during an asynchronous save (run by tests/test_ckpt_async.py).

Saves ``<dir>/s1``, starts an asynchronous save of ``<dir>/s2`` whose background write stalls
after writing its data, and rank 0 kills itself with SIGKILL once the data file is there, after
leaving ``<dir>/killed``: the job ends mid-save.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import mpicomm
import torch

import ckpt
from ckpt import api as ckpt_api


def make(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def main(root: str) -> None:
    comm = mpicomm.init()
    net = make(0)
    ckpt.save(os.path.join(root, "s1"), model=net, step=1, comm=comm)
    real = ckpt_api.write_items

    def stalls(*a, **kw):
        out = real(*a, **kw)
        open(os.path.join(root, f"written.{comm.rank}"), "w").close()  # this rank's data is written
        time.sleep(600)  # and its save never finishes: the job is killed meanwhile
        return out

    ckpt_api.write_items = stalls
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    ckpt.save(os.path.join(root, "s2"), model=net, step=2, comm=comm, async_save=True)
    if comm.rank == 0:
        deadline = time.time() + 120
        while time.time() < deadline:  # every rank wrote its part of the new checkpoint's data
            if all(os.path.exists(os.path.join(root, f"written.{r}")) for r in range(comm.size)):
                break
            time.sleep(0.05)
        open(os.path.join(root, "killed"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
