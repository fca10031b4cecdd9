"""One rank of torch's own distributed test suite (``_DistTestBase``), as upstream's spawn flow runs it.

Launched by ``tests/conformance.py`` as ``mpiexec -n N python -m mpi4py tests/conformance_job.py
--backend B --skips-of S --tests FILE --results DIR``. Each rank runs the named tests in order;
for every test it does what a child of torch's ``test_distributed_spawn.py`` does: a fresh
TEMP_DIR (``barrier``, ``test_dir``, ``init_dir``) and init file made by the parent (rank 0
here), ``TestDistBackend._run`` itself (``init_process_group`` with the ``file://`` init method,
the test's custom timeout, the file barrier, the rng seed, the test, ``destroy_process_group``),
and the exit code it ends with (0, a skip code, or the error code with the traceback sent through
the pipe). The suite runs as it runs for backend ``S`` (``BACKEND=S``: its skips, and the paths
its tests take by backend name), and every process group it creates for ``S`` is one of backend
``B`` (``init_process_group`` and ``new_group`` given ``S`` get ``B``): ``B`` stands in for ``S``.

Each rank appends one JSON line per test to ``DIR/rank<R>.jsonl`` (``test``, ``code``,
``seconds``, ``error``; ``code`` is "skip" for a test unittest skips before it starts, ``error``
then its reason), so the driver can name a test that hangs or kills the job, and start again
after it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, help="the backend the tests run on")
    p.add_argument("--skips-of", default=None,
                   help="decide skips as upstream does for this backend (default: --backend)")
    p.add_argument("--tests", required=True, help="file with one test name per line")
    p.add_argument("--results", required=True, help="directory for the per-rank results")
    return p.parse_args(argv)


def _import_suite(backend: str, skips_of: str):
    """torch's distributed test module, its skips decided for ``skips_of``, run on ``backend``."""
    os.environ["BACKEND"] = skips_of
    os.environ["WORLD_SIZE"] = str(WORLD.Get_size())
    # the module reads INIT_METHOD at import (tests that need file:// check it in decorators);
    # each test then gets its own file, as upstream's parent gives each test a temp dir
    os.environ["INIT_METHOD"] = "file://" + os.path.join(tempfile.gettempdir(), "unused_init")
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    if backend == "mpicomm":
        import mpicomm  # noqa: F401 - registers the backend
    from torch.testing._internal.distributed import distributed_test as dt

    if backend != skips_of:
        _stand_in(backend, skips_of)
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        # torch checks profiler events only for backends on these allowlists
        for name in ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                     "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            getattr(dt, name).append(backend)

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    return dt, TestDistBackendWithSpawn


def _stand_in(backend: str, skips_of: str) -> None:
    """Groups the suite creates for backend ``skips_of`` are created on ``backend``."""
    import torch.distributed as dist

    def swap(name):
        return backend if name is not None and str(name).lower() == skips_of else name

    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(*args, backend=None, **kwargs):
        return init(*args, backend=swap(backend), **kwargs)

    def new_group_(*args, backend=None, **kwargs):
        return new_group(*args, backend=swap(backend), **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group_


def _fresh_dirs(dt) -> tuple[str, str]:
    """(TEMP_DIR, init file) made by rank 0 as upstream's parent makes them, the same on all ranks."""
    made = None
    if WORLD.Get_rank() == 0:
        temp = tempfile.mkdtemp(prefix="torch-suite-")
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(temp, sub))
        fd, file_name = tempfile.mkstemp(dir=temp, prefix="init-")
        os.close(fd)
        made = (temp, file_name)
    temp, file_name = WORLD.bcast(made, root=0)
    os.environ["TEMP_DIR"] = temp
    init_method = "file://" + os.path.join(temp, "init_dir", "shared_init_file")
    os.environ["INIT_METHOD"] = init_method
    dt.INIT_METHOD = init_method
    dt.Barrier.barrier_id = 0  # a fresh child's
    return temp, file_name


def _run_one(dt, cls, name: str, file_name: str) -> tuple[int, str]:
    """Upstream's child: ``TestDistBackend._run``; (exit code, traceback or '')."""
    parent, child = multiprocessing.Pipe()
    code, error = 0, ""
    try:
        cls._run(WORLD.Get_rank(), name, file_name, child)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - _run raised before its own handler (init failed)
        code, error = dt.MultiProcessTestCase.TEST_ERROR_EXIT_CODE, traceback.format_exc()
    if code == dt.MultiProcessTestCase.TEST_ERROR_EXIT_CODE and not error and parent.poll(1):
        error = parent.recv()
    parent.close()
    child.close()
    return code, error


def _unittest_skip(cls, name: str) -> str | None:
    """The reason unittest would skip the test before running it (``skip*`` decorators), if any."""
    method = getattr(cls, name)
    for obj in (cls, method):
        if getattr(obj, "__unittest_skip__", False):
            return getattr(obj, "__unittest_skip_why__", "") or "skipped"
    return None


def _cleanup(dist) -> None:
    """What the end of a child process would undo: every process group of this test."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the next test starts from scratch either way
            pass


def main(argv=None) -> int:
    args = _args(argv)
    rank = WORLD.Get_rank()
    dt, cls = _import_suite(args.backend, args.skips_of or args.backend)
    import torch.distributed as dist

    with open(args.tests) as f:
        names = [line.strip() for line in f if line.strip()]
    os.makedirs(args.results, exist_ok=True)
    out = open(os.path.join(args.results, f"rank{rank}.jsonl"), "a")
    environ = dict(os.environ)
    for name in names:
        skip = _unittest_skip(cls, name)
        if skip is not None:  # unittest skips it before setUp: no process is started
            out.write(json.dumps({"test": name, "code": "skip", "seconds": 0.0,
                                  "error": skip}) + "\n")
            out.flush()
            continue
        temp, file_name = _fresh_dirs(dt)
        WORLD.Barrier()
        began = time.monotonic()
        code, error = _run_one(dt, cls, name, file_name)
        seconds = time.monotonic() - began
        _cleanup(dist)
        out.write(json.dumps({"test": name, "code": code, "seconds": round(seconds, 3),
                              "error": error[-4000:]}) + "\n")
        out.flush()
        os.fsync(out.fileno())
        WORLD.Barrier()
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        os.environ.clear()
        os.environ.update(environ)  # tests set variables (MASTER_PORT, debug levels, ...)
    out.close()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
