"""Simulated cluster: run a bench program with one rank per network namespace over rate-limited links.

``python -m bench netsim --hosts H --rate 1gbit [--delay 0.1ms] -- <bench program and arguments>``

Layout (all names start with ``mpicomm-<pid>-``, so concurrent runs never collide)::

    mpicomm-<pid>-h0  eth0 10.77.0.1/24 ─┐
    mpicomm-<pid>-h1  eth0 10.77.0.2/24 ─┼─ veth ─ bridge br0 in mpicomm-<pid>-sw
    ...                                  ┘

Each host's egress (eth0) and the switch's egress towards it (its port) are limited with ``tc tbf``
to ``--rate``; ``--delay`` adds a one-way ``netem`` delay on each host's egress. The addresses exist
only inside these namespaces, which have no route anywhere else. Host names resolve through
``/etc/netns/<namespace>/hosts`` (bind-mounted by ``ip netns exec``). MPICH's Hydra launches one
proxy per host through a generated "ssh" script that enters the host's namespace and its own UTS
namespace (so each rank sees its own host name); ``MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self`` keeps
all traffic on the links. Everything is removed afterwards, also after a failure, a timeout,
SIGTERM or Ctrl-C; ``--cleanup`` removes what a killed run left behind.

This module must not initialise MPI: it only launches ``mpiexec``.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

__all__ = ["PREFIX", "SimNet", "NetsimError", "parse_rate", "parse_delay", "preflight",
           "leftovers", "cleanup_stale", "mpiexec_command", "main"]

PREFIX = "mpicomm-"
SUBNET = "10.77.0"          # private; exists only inside the namespaces created here
NETNS_ETC = "/etc/netns"    # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
MAX_HOSTS = 200


class NetsimError(RuntimeError):
    """Raised when the simulated network cannot be set up or used."""


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


def format_rate(bits: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


# ---------------------------------------------------------------------------------------------
# checks

def preflight() -> str | None:
    """Return why a simulated network cannot be made here (root, ip, tc, unshare), or None."""
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return (f"netsim needs {', '.join(missing)} on PATH (Debian/Ubuntu: apt-get install "
                f"iproute2 util-linux)")
    if os.geteuid() != 0:
        return "netsim needs root (it creates network namespaces and sets tc limits); run it as root"
    return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetsimError(f"command failed (exit {proc.returncode}): {shlex.join(cmd)}: "
                          f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces, /etc/netns entries and root-namespace links whose names start with ``prefix``."""
    found = [f"netns {n}" for n in list_namespaces() if n.startswith(prefix)]
    if os.path.isdir(NETNS_ETC):
        found += [f"{NETNS_ETC}/{n}" for n in os.listdir(NETNS_ETC) if n.startswith(prefix)]
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(prefix):
            found.append(f"link {parts[1].strip()}")
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """Kill every process left in one of our namespaces (all were started by this program)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for _ in range(20):
            if not _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                return
            time.sleep(0.1)


def _remove_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    if ns in list_namespaces():
        _run(["ip", "netns", "del", ns], check=False)
    etc = os.path.join(NETNS_ETC, ns)
    if os.path.isdir(etc):
        shutil.rmtree(etc, ignore_errors=True)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces of netsim runs whose process is gone; return what was removed."""
    removed = []
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    names = set(list_namespaces())
    if os.path.isdir(NETNS_ETC):
        names |= set(os.listdir(NETNS_ETC))
    for name in sorted(names):
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_namespace(name)
            removed.append(name)
    _remove_netns_etc_if_empty()
    return removed


def _remove_netns_etc_if_empty() -> None:
    try:
        os.rmdir(NETNS_ETC)  # only succeeds when empty
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# the network

_LAUNCHER = """#!/bin/sh
# Hydra "ssh" launcher for netsim: {launcher} [ssh options] HOST COMMAND...
# Runs COMMAND (joined and re-parsed by sh, as ssh does) inside HOST's network namespace, in a
# UTS namespace of its own whose host name is HOST.
while [ "${{1#-}}" != "$1" ]; do shift; done
host="$1"; shift
case "$host" in
    {prefix}h[0-9]*) ;;
    *) echo "netsim launcher: unknown host '$host' (expected {prefix}hN)" >&2; exit 127 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


class SimNet:
    """H hosts (network namespaces) on one bridge, each link limited to ``rate_bits`` per direction."""

    def __init__(self, hosts: int, rate_bits: float, delay_s: float = 0.0,
                 prefix: str | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"expected 1 <= hosts <= {MAX_HOSTS}, got {hosts}")
        self.hosts = hosts
        self.rate_bits = rate_bits
        self.delay_s = delay_s
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-"
        self.switch = f"{self.prefix}sw"
        self.host_names = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.workdir: str | None = None
        self.launcher: str | None = None
        self._created: list[str] = []

    # -- description
    def describe(self) -> str:
        delay = f", one-way delay {self.delay_s * 1e3:g} ms" if self.delay_s else ""
        return (f"netsim: {self.hosts} hosts, {format_rate(self.rate_bits)} links "
                f"({self.rate_bits / 8e9:g} GB/s per direction){delay}")

    # -- set-up
    def up(self) -> "SimNet":
        """Create the namespaces, links, limits, host files and launcher script."""
        problem = preflight()
        if problem:
            raise NetsimError(problem)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _ns(self, ns: str, *cmd: str) -> None:
        _run(["ip", "-n", ns, *cmd])

    def _tc(self, ns: str, dev: str, delay: bool) -> None:
        rate_bytes = self.rate_bits / 8
        burst = int(max(64 << 10, rate_bytes / 250))   # at least one timer tick's worth
        tbf = ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst),
               "latency", "50ms"]
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        if delay and self.delay_s > 0:
            try:
                _run(base + ["root", "handle", "1:", "netem", "delay",
                             f"{self.delay_s * 1e6:.0f}us", "limit", "100000"])
            except NetsimError as exc:
                if "unknown" in str(exc).lower():
                    raise NetsimError(
                        "--delay needs tc's netem qdisc (kernel option CONFIG_NET_SCH_NETEM), "
                        "which this kernel lacks; run without --delay") from None
                raise
            _run(base + ["parent", "1:1", "handle", "10:", *tbf])
        else:
            _run(base + ["root", "handle", "1:", *tbf])

    def _up(self) -> None:
        for ns in [self.switch, *self.host_names]:
            if ns in list_namespaces():
                raise NetsimError(f"namespace {ns} exists already (another run with this pid?)")
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
        self._ns(self.switch, "link", "add", "br0", "type", "bridge")
        self._ns(self.switch, "link", "set", "br0", "up")
        self._ns(self.switch, "link", "set", "lo", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for addr, name in zip(self.addresses, self.host_names))
        for i, (ns, addr) in enumerate(zip(self.host_names, self.addresses)):
            port = f"p{i}"
            # both ends are created inside our namespaces: nothing appears in the root namespace
            self._ns(ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                     "netns", self.switch)
            self._ns(self.switch, "link", "set", port, "master", "br0")
            self._ns(self.switch, "link", "set", port, "up")
            self._ns(ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._ns(ns, "link", "set", "eth0", "up")
            self._ns(ns, "link", "set", "lo", "up")
            self._tc(ns, "eth0", delay=True)
            self._tc(self.switch, port, delay=False)
            etc = os.path.join(NETNS_ETC, ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            with open(os.path.join(etc, "hostname"), "w") as f:
                f.write(ns + "\n")
        self.workdir = tempfile.mkdtemp(prefix=self.prefix)
        self.launcher = os.path.join(self.workdir, "launch.sh")
        with open(self.launcher, "w") as f:
            f.write(_LAUNCHER.format(prefix=self.prefix, launcher=self.launcher))
        os.chmod(self.launcher, stat.S_IRWXU)

    # -- tear-down
    def down(self) -> None:
        """Remove everything this network created; safe to call twice or after a partial set-up."""
        for ns in reversed(self._created):
            _remove_namespace(ns)
        self._created.clear()
        if self.workdir and os.path.isdir(self.workdir):
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None
        _remove_netns_etc_if_empty()

    def __enter__(self) -> "SimNet":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- running
    def exec_prefix(self, host: int = 0) -> list[str]:
        """Command prefix that runs a program on host ``host`` (its namespace and host name)."""
        ns = self.host_names[host]
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', ns]

    def environment(self) -> dict:
        """Environment for mpiexec and the ranks: all traffic on the simulated links."""
        env = dict(os.environ)
        env.update({
            "MPIR_CVAR_NOLOCAL": "1",          # no shared memory between "hosts"
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": "eth0",
            "FI_PROVIDER": env.get("FI_PROVIDER", "tcp"),
            "GLOO_SOCKET_IFNAME": "eth0",
            "MPICOMM_BENCH_NETWORK": self.describe(),
        })
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns about reverse name lookups
        return env


def _find_mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = local if os.access(local, os.X_OK) else shutil.which("mpiexec")
    if not path:
        raise NetsimError("mpiexec not found (install the embedded MPICH: pip install mpich)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in version.upper():
        raise NetsimError(f"netsim needs MPICH's Hydra mpiexec (its ssh launcher options); "
                          f"{path} is not Hydra")
    return path


def mpiexec_command(net: SimNet, bench_args: list[str], mpiexec: str | None = None) -> list[str]:
    """The full command: enter host 0, then mpiexec with one rank per simulated host."""
    mpiexec = mpiexec or _find_mpiexec()
    return net.exec_prefix(0) + [
        mpiexec, "-launcher", "ssh", "-launcher-exec", net.launcher,
        "-hosts", ",".join(net.host_names), "-n", str(net.hosts),
        sys.executable, "-m", "mpi4py", "-m", "bench", *bench_args]


class _Interrupted(Exception):
    pass


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise _Interrupted(signal.Signals(signum).name)


def run_on(net: SimNet, bench_args: list[str], timeout_s: float) -> int:
    """Run ``python -m bench <bench_args>`` across the hosts; the benchmark's exit code."""
    cmd = mpiexec_command(net, bench_args)
    proc = subprocess.Popen(cmd, env=net.environment(), start_new_session=True)
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
                    "rate-limited links, one rank per host. Needs root, ip, tc and unshare.",
        epilog="example: python -m bench netsim --hosts 2 --rate 1gbit -- collectives "
               "--ops all_reduce --peers mpi4py --sizes 64M")
    parser.add_argument("--hosts", type=int, default=2, help="number of simulated hosts (default 2)")
    parser.add_argument("--rate", default="1gbit",
                        help="link rate per direction, tc syntax (default 1gbit)")
    parser.add_argument("--delay", default="0", help="one-way delay added per host, e.g. 0.1ms")
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
        net = SimNet(args.hosts, rate, delay)
    except ValueError as exc:
        print(f"netsim: {exc}", file=sys.stderr)
        return 2
    old = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        net.up()
        print(f"# {net.describe()}; namespaces {net.prefix}h0..h{args.hosts - 1}, "
              f"bridge in {net.switch}", flush=True)
        return run_on(net, bench_args, args.timeout)
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
