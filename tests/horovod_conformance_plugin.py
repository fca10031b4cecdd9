"""pytest plugin for the Horovod conformance job (loaded with ``-p``, on every rank):
``import horovod.torch as hvd`` resolves to ``mpicomm.horovod``, and each test's outcome on
this rank goes, one JSON line each, to ``$HVD_CONFORMANCE_RESULTS/rank<R>.jsonl``."""
from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
import types
import unittest.mock

import mpicomm.horovod as _hvd



def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package: `import a.b` looks in sys.modules first
    mod.__dict__.update(attrs)
    sys.modules.setdefault(name, mod)
    return sys.modules[name]


def _in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Horovod runner's helper, which the suite's common.py imports (test_torch.py never runs it)."""
    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    t.start()
    return t


_module("horovod", torch=_hvd)
sys.modules.setdefault("horovod.torch", _hvd)
_module("horovod.runner")
_module("horovod.runner.util")
_module("horovod.runner.util.threads", in_thread=_in_thread)
# common.py imports these at the top for helpers test_torch.py does not call
sys.modules.setdefault("mock", unittest.mock)
try:
    import cloudpickle  # noqa: F401
except ImportError:
    _module("cloudpickle", dumps=pickle.dumps, loads=pickle.loads)

_RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
_OUT = os.environ.get("HVD_CONFORMANCE_RESULTS")
_started: dict[str, float] = {}


def _write(rec: dict) -> None:
    if _OUT:
        with open(os.path.join(_OUT, f"rank{_RANK}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = time.monotonic()
    _write({"test": nodeid.rsplit("::", 1)[-1], "event": "start"})


def pytest_runtest_logreport(report):
    name = report.nodeid.rsplit("::", 1)[-1]
    if report.when == "call" or report.outcome != "passed":
        detail = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2])
        elif report.outcome == "failed":
            detail = str(report.longrepr)[-3000:]
        _write({"test": name, "event": "end", "when": report.when, "outcome": report.outcome,
                "detail": detail,
                "seconds": round(time.monotonic() - _started.get(report.nodeid, time.monotonic()), 2)})


def _without_muon():
    """The suite builds every ``torch.optim.Optimizer.__subclasses__()`` on a model with 1-D
    biases; torch >= 2.9's ``Muon`` refuses 1-D parameters at construction, whatever the
    Horovod, so the job leaves Muon out of that list (and says so)."""
    import torch

    if not any(c.__name__ == "Muon" for c in type.__subclasses__(torch.optim.Optimizer)):
        return
    torch.optim.Optimizer.__subclasses__ = classmethod(
        lambda cls: [c for c in type.__subclasses__(cls) if c.__name__ != "Muon"])


_without_muon()


def pytest_runtest_teardown(item, nextitem):
    """After each test, remove the process sets it left registered (test_process_set_barrier_op
    leaves [0] and [1]): the suite's tearDown gets the same by shutting Horovod down after
    every test under Gloo, which cannot be re-initialised under MPI (collective, every rank)."""
    from mpicomm.horovod.basics import state

    if state.world is not None:
        for set_id in sorted(state.sets):
            if set_id != 0:
                _hvd.remove_process_set(state.sets[set_id])
