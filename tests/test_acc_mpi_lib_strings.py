"""MPI library strings are cleaned once where they are read: no NUL, no trailing whitespace."""
from __future__ import annotations

import json

import pytest
from mpi4py import MPI

from accelerators import mpi_lib
from accelerators.__main__ import main

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="prints from rank 0 only; run in the single-process pass")

# As Open MPI 5.0.11 returns it: one line ending in a NUL byte.
OPEN_MPI = ("Open MPI v5.0.11, package: Open MPI user Distribution, ident: 5.0.11, "
            "repo rev: v5.0.11rc1, Sep 16, 2026\x00")


def test_clean_strips_nul_and_trailing_whitespace():
    assert mpi_lib.clean(OPEN_MPI) == OPEN_MPI[:-1]
    assert mpi_lib.clean("Open MPI v5 \x00 \n") == "Open MPI v5"
    assert mpi_lib.clean("MPICH Version:\t5.0.2\nMPICH Release date: x\n") == (
        "MPICH Version:\t5.0.2\nMPICH Release date: x")
    assert mpi_lib.clean("") == ""


def test_nul_never_reaches_the_summary_the_cli_or_bench(monkeypatch, capsys):
    monkeypatch.setattr(MPI, "Get_library_version", lambda: OPEN_MPI)
    assert "\x00" not in mpi_lib.library_version()
    summary = mpi_lib.library_summary()
    assert summary["library"].startswith("Open MPI v5.0.11") and summary["library"].endswith("2026")
    assert main(["--json"]) == 0
    out = capsys.readouterr().out
    assert "\x00" not in out and "\\u0000" not in out
    assert json.loads(out)[0]["mpi"]["library"] == summary["library"]
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "\x00" not in text and "(Open MPI v5.0.11" in text

    from bench.common import environment_info

    info = environment_info(MPI.COMM_SELF)
    assert info["mpi_library"].startswith("Open MPI v5.0.11") and "\x00" not in info["mpi_library"]
