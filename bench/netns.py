"""Network namespaces for netsim: H simulated hosts on one bridge, links limited with ``tc``.

Layout (all names start with ``mpicomm-<pid>-``, so concurrent runs never collide)::

    mpicomm-<pid>-h0  eth0 10.77.0.1/24 ─┐
    mpicomm-<pid>-h1  eth0 10.77.0.2/24 ─┼─ veth ─ bridge br0 in mpicomm-<pid>-sw
    ...                                  ┘

Each host's egress (eth0) and the switch's egress towards it (its port) are limited with ``tc tbf``
to the rate; a delay adds a one-way ``netem`` delay on each host's egress (where the kernel has
netem). The addresses exist only inside these namespaces, which have no route anywhere else. Host
names resolve through ``/etc/netns/<namespace>/hosts`` (bind-mounted by ``ip netns exec``). The
generated launcher script (an "ssh" for MPI launchers) enters a host's namespace and its own UTS
namespace, so each rank sees its own host name. ``bench.netsim`` runs MPI jobs on this network.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time

__all__ = ["PREFIX", "SimNet", "NetsimError", "preflight", "leftovers", "cleanup_stale",
           "list_namespaces", "format_rate"]

PREFIX = "mpicomm-"
SUBNET = "10.77.0"          # private; exists only inside the namespaces created here
NETNS_ETC = "/etc/netns"    # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
MAX_HOSTS = 200
LINK = "eth0"               # each host's link to the switch


class NetsimError(RuntimeError):
    """Raised when the simulated network cannot be set up or used."""


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
                        "--delay is not available here: it needs tc's netem qdisc (kernel option "
                        "CONFIG_NET_SCH_NETEM), which this kernel lacks; run without --delay"
                    ) from None
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
    def tx_bytes(self, host: int) -> int:
        """Bytes host ``host`` has sent on its link so far (its eth0 transmit counter)."""
        ns = self.host_names[host]
        out = _run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{LINK}/statistics/tx_bytes"])
        return int(out.stdout.strip())

    def exec_prefix(self, host: int = 0) -> list[str]:
        """Command prefix that runs a program on host ``host`` (its namespace and host name)."""
        ns = self.host_names[host]
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', ns]
