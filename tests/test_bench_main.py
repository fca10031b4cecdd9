"""python -m bench: dispatch to the programs, usage, unknown and missing programs."""
from __future__ import annotations

import subprocess
import sys
import os

from bench import __main__ as entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_usage_lists_every_program(capsys):
    assert entry.main([]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "collectives", "compressed", "ckpt", "netsim"):
        assert name in out


def test_unknown_program(capsys):
    assert entry.main(["nonsense"]) == 2
    assert "unknown program 'nonsense'" in capsys.readouterr().err


def test_every_program_module_imports():
    import importlib

    for name, (module, _) in entry.PROGRAMS.items():
        assert callable(importlib.import_module(module).main), name


def test_dispatch_passes_arguments():
    proc = subprocess.run([sys.executable, "-m", "bench", "netsim", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--rate" in proc.stdout
