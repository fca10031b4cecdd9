"""A replacement's first moments. ``elastic.grow`` spawns ``python [the job's interpreter options]
.../elastic/newcomer.py PROGRAM...``: this file starts MPI and merges with the job before anything
else is imported (so the job's spawn and merge return at once and it trains on while the newcomer
imports torch and the program), then runs PROGRAM as ``python PROGRAM...`` would. Run as a
script, it must import nothing heavy: ``elastic.grow.join`` finds the merged communicator in
``merged`` later. A spare (``elastic.run(spare=True)``) is started with ``--elastic-nice=N``
before PROGRAM: the heavy imports first run in a thread at nice N (on Linux a thread's nice is
its own: the thread that trains later keeps the process's priority, which an unprivileged
process could not raise back)."""
from __future__ import annotations

import importlib
import os
import runpy
import signal
import sys
import threading

#: The intra-communicator with the job that spawned this process (None: not started through here).
merged = None
#: Interpreter options that take a value as the next argument.
_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
#: The option before PROGRAM that imports ``WARM`` first, in a thread at that nice value.
NICE_OPTION = "--elastic-nice="
#: What a spare imports ahead: torch, what building a torch optimizer imports, this project.
WARM = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "mpicomm", "elastic")
#: Seconds a spawn may take, on the job's side and on the replacement's (default 60).
SPAWN_TIMEOUT_ENV = "MPICOMM_ELASTIC_SPAWN_TIMEOUT_S"


def spawn_timeout() -> float:
    """Seconds a spawn may take before each rank still inside it leaves the job
    (``MPICOMM_ELASTIC_SPAWN_TIMEOUT_S``), and a replacement that did not merge with the job by
    then leaves."""
    raw = os.environ.get(SPAWN_TIMEOUT_ENV, "60")
    try:
        s = float(raw)
    except ValueError:
        s = 0.0
    if not s > 0:
        raise ValueError(f"elastic: expected {SPAWN_TIMEOUT_ENV} a number of seconds > 0, got {raw!r}")
    return s


def options(nice: int) -> list[str]:
    """This file's options for a replacement whose imports run at ``nice`` (0: none)."""
    return [f"{NICE_OPTION}{int(nice)}"] if nice else []


def strip_options(argv: list[str]) -> list[str]:
    """``argv`` (what follows this file on a command line) without this file's options."""
    return argv[1:] if argv and argv[0].startswith(NICE_OPTION) else argv


def warm_up(nice: int) -> None:
    """Import ``WARM`` in a thread at ``nice`` (Linux; elsewhere at the process's priority);
    returns once it is done."""
    def work() -> None:
        if sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError:
                pass
        for name in WARM:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the program's own import reports it
                pass
    t = threading.Thread(target=work, name="elastic-warm-up", daemon=True)
    t.start()
    t.join()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``sys.orig_argv[1:]`` as (interpreter options, program): ``["-m", module, ...]``,
    ``["-c", code, ...]`` or ``[script, ...]``; None for what cannot be started again (stdin)."""
    opts: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-c"):
            return (opts, argv[i:]) if i + 1 < len(argv) else None
        if a == "-" or not a.startswith("-"):
            return (opts, argv[i:]) if a != "-" else None
        if a in _WITH_VALUE:
            opts.extend(argv[i:i + 2])
            i += 2
            continue
        if not a.startswith("--") and len(a) > 2 and a[1] not in "WX" and ("m" in a[2:] or "c" in a[2:]):
            return None     # a flag group ending in -m or -c ("-um"): not worth parsing
        opts.append(a)
        i += 1
    return None


def run_program(program: list[str]) -> None:
    """Run ``program`` (as ``split_argv`` gives it) as the interpreter would, ``sys.argv`` and
    ``sys.path[0]`` included."""
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    elif program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        sys.path[0] = ""
        exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
        runpy.run_path(program[0], run_name="__main__")


if __name__ == "__main__":
    sys.modules["elastic.newcomer"] = sys.modules[__name__]   # where elastic.grow looks for it
    sys.path[0] = os.getcwd()       # not this package's folder (its modules' names are plain words)
    # SIGALRM (its default action ends the process) where MPI does not start with the job in time:
    # the job's ranks died inside the spawn, nobody is left to merge with. (MPI_Init holds the
    # GIL: no Python thread or handler would run.)
    signal.alarm(max(1, round(spawn_timeout())))
    from mpi4py import MPI

    merged = MPI.Comm.Get_parent().Merge(high=True)
    signal.alarm(0)
    # Before it joined, the job waits for this process in an agreement: leaving through
    # MPI_Finalize would keep it waiting; an exit without it is a failure the job sees.
    try:
        argv = sys.argv[1:]
        if argv and argv[0].startswith(NICE_OPTION):
            warm_up(int(argv[0][len(NICE_OPTION):]))
            argv = argv[1:]
        run_program(argv)
    except SystemExit as e:
        grow = sys.modules.get("elastic.grow")
        if grow is not None and grow._joined:
            raise
        print(f"elastic: this replacement exited before it joined the job ({e.code!r})", file=sys.stderr, flush=True)
        os._exit(e.code if isinstance(e.code, int) and e.code else 1)
    except BaseException:   # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
