"""A replacement's first moments. ``elastic.grow`` spawns ``python [the job's interpreter options]
.../elastic/newcomer.py PROGRAM...``: this file starts MPI and merges with the job before anything
else is imported (so the job's spawn and merge return at once and it trains on while the newcomer
imports torch and the program), then runs PROGRAM as ``python PROGRAM...`` would. Run as a
script, it must import nothing heavy: ``elastic.grow.join`` finds the merged communicator in
``merged`` later."""
from __future__ import annotations

import os
import runpy
import sys

#: The intra-communicator with the job that spawned this process (None: not started through here).
merged = None
#: Interpreter options that take a value as the next argument.
_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


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
    from mpi4py import MPI

    merged = MPI.Comm.Get_parent().Merge(high=True)
    # Before it joined, the job waits for this process in an agreement: leaving through
    # MPI_Finalize would keep it waiting; an exit without it is a failure the job sees.
    try:
        run_program(sys.argv[1:])
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
