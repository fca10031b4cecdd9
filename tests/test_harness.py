"""The test harness itself: a failing rank must end the whole launch quickly, never hang it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from mpitest import mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mpiexec(n, *args, timeout=60):
    t0 = time.monotonic()
    proc = subprocess.run([*mpiexec_cmd(n), sys.executable, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        comm.Barrier()  # rank 0 would wait here forever without the abort
    """))
    proc, elapsed = _mpiexec(2, "-m", "mpi4py", str(script))
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f}s to end"
    assert "rank 1 fails on purpose" in proc.stderr


def test_failing_pytest_rank_aborts_the_pytest_job(tmp_path):
    test_file = tmp_path / "test_fail_one_rank.py"
    test_file.write_text(textwrap.dedent("""
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_one_rank_fails():
            assert MPI.COMM_WORLD.rank != 1, "rank 1 fails on purpose"

        @pytest.mark.mpi(min_size=2)
        def test_then_a_collective():
            MPI.COMM_WORLD.Barrier()
    """))
    proc, elapsed = _mpiexec(2, "-m", "mpi4py", "scripts/mpi_pytest.py", "--with-mpi", "-q",
                             "-p", "no:cacheprovider", "--rootdir", ROOT,
                             "-c", os.path.join(ROOT, "pyproject.toml"),
                             "--confcutdir", ROOT, "-o", f"testpaths={tmp_path}",
                             str(test_file), timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 60, f"took {elapsed:.1f}s to end"
    assert "rank 1 fails on purpose" in proc.stderr + proc.stdout


@pytest.mark.mpi(min_size=1)
def test_shared_tmp_path_is_the_same_on_every_rank(shared_tmp_path, world):
    from mpitest import assert_all

    paths = world.allgather(str(shared_tmp_path))
    assert_all(len(set(paths)) == 1 and shared_tmp_path.is_dir(), f"paths differ: {paths}")


# ---------------------------------------------------------------------------------------------
# scripts/mpirun.sh: the one launch logic (flavour, root variables, oversubscription)

_FAKE_MPIEXEC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo '{banner}'; exit 0; fi
echo "args: $*"
echo "root-vars: ${{OMPI_ALLOW_RUN_AS_ROOT:-unset}} ${{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-unset}}"
echo "btl: ${{OMPI_MCA_btl:-unset}}"
"""


_BATCH = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")


def _fake_launch(tmp_path, banner, n, opts=(), env_extra=None, btl=False):
    fake = tmp_path / "mpiexec"
    fake.write_text(_FAKE_MPIEXEC.format(banner=banner))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_btl", "OMPI_MCA_mpi_ft")) and k not in _BATCH}
    env.update(env_extra or {})
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), "--mpiexec",
                           str(fake), "-n", str(n), *opts, "prog", "-n", "99"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.split("args: ")[1].splitlines()[0].split()
    root_vars = proc.stdout.split("root-vars: ")[1].splitlines()[0].split()
    if btl:
        return proc.stdout.split("btl: ")[1].splitlines()[0]
    return args, root_vars


def _cores():
    out = subprocess.run(["lscpu", "-p=core,socket"], capture_output=True, text=True).stdout
    physical = len({line for line in out.splitlines() if line and not line.startswith("#")})
    online = os.cpu_count() if not hasattr(os, "sched_getaffinity") else len(os.sched_getaffinity(0))
    return physical if 0 < physical < online else online


def test_mpirun_sh_open_mpi_root_variables_and_oversubscription(tmp_path):
    cores = _cores()
    root = os.geteuid() == 0
    args, root_vars = _fake_launch(tmp_path, "mpiexec (Open MPI) 5.0.11", cores)
    assert args == ["-n", str(cores), "prog", "-n", "99"], args  # no oversubscription needed
    assert root_vars == (["1", "1"] if root else ["unset", "unset"])
    args, root_vars = _fake_launch(tmp_path, "mpiexec (Open MPI) 5.0.11", cores + 1)
    assert args == ["--oversubscribe", "-n", str(cores + 1), "prog", "-n", "99"], args
    assert root_vars == (["1", "1"] if root else ["unset", "unset"])


def test_mpirun_sh_leaves_out_open_mpis_libfabric_transport_on_one_host_only(tmp_path):
    """btl ofi added 1 s to every MPI_Init here; left out on one host, kept wherever the user or
    a multi-host launch decides, and never set under --with-ft (mpicomm's ULFM defaults set
    btl tcp,self only where the variable is unset: over shared memory survivors hang)."""
    ompi = "mpiexec (Open MPI) 5.0.11"
    assert _fake_launch(tmp_path, ompi, 1, btl=True) == "^ofi"
    for opts in (["--with-ft", "ulfm"], ["--host", "a,b"], ["--hostfile", "hosts"], ["-H", "a:2"],
                 ["--mca", "btl", "self,tcp"], ["--mca", "mpi_ft_enable", "1"]):
        assert _fake_launch(tmp_path, ompi, 1, opts, btl=True) == "unset", opts
    for var in (*_BATCH, "OMPI_MCA_mpi_ft_enable"):
        assert _fake_launch(tmp_path, ompi, 1, env_extra={var: "7"}, btl=True) == "unset", var
    assert _fake_launch(tmp_path, ompi, 1, env_extra={"OMPI_MCA_btl": "self,sm"}, btl=True) == "self,sm"
    assert _fake_launch(tmp_path, "HYDRA build details:", 1, btl=True) == "unset"


def test_mpirun_sh_mpich_gets_no_extra_flags_or_variables(tmp_path):
    args, root_vars = _fake_launch(tmp_path, "HYDRA build details:", _cores() + 2)
    assert args == ["-n", str(_cores() + 2), "prog", "-n", "99"]
    assert root_vars == ["unset", "unset"]


def test_mpirun_sh_more_ranks_than_cores_runs():
    n = _cores() + 1
    proc, _ = _mpiexec(n, "-c", "from mpi4py import MPI; c = MPI.COMM_WORLD; ranks = c.gather(c.rank)\n"
                                "if c.rank == 0: print('ranks', *ranks)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["ranks", *map(str, range(n))], proc.stdout
