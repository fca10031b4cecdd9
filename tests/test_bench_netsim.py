"""bench netsim: argument parsing, the no-root message, and (as root) set-up, runs and tear-down."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench import common, netns, netsim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# no root needed

@pytest.mark.parametrize("text,bits", [("1gbit", 1e9), ("10gbit", 1e10), ("100mbit", 1e8),
                                       ("2.5Gbit", 2.5e9), ("125mbps", 1e9), ("800kbit", 8e5)])
def test_parse_rate(text, bits):
    assert netsim.parse_rate(text) == pytest.approx(bits)


def test_parse_rate_and_delay_errors():
    with pytest.raises(ValueError, match="expected a rate"):
        netsim.parse_rate("fast")
    with pytest.raises(ValueError, match="expected a delay"):
        netsim.parse_delay("soon")
    assert netsim.parse_delay("0.1ms") == pytest.approx(1e-4)
    assert netsim.parse_delay("50us") == pytest.approx(5e-5)


def test_names_are_unique_per_process_and_fit():
    net = netsim.SimNet(3, 1e9)
    assert net.prefix == f"mpicomm-{os.getpid()}-"
    assert net.host_names == [f"{net.prefix}h{i}" for i in range(3)]
    assert len(set(net.addresses)) == 3 and all(a.startswith("10.77.0.") for a in net.addresses)
    assert "3 hosts" in net.describe() and "1gbit" in net.describe()
    with pytest.raises(ValueError, match="hosts"):
        netsim.SimNet(0, 1e9)


def test_launcher_refuses_unknown_hosts(tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text(netns._LAUNCHER.format(prefix="mpicomm-1-", launcher=script))
    proc = subprocess.run(["sh", str(script), "-x", "somehost", "true"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 127
    assert "unknown host 'somehost'" in proc.stderr


def test_without_root_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    assert "needs root" in netsim.preflight()
    assert netsim.main(["--hosts", "2", "--", "collectives"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_without_tools_a_clear_message(monkeypatch):
    monkeypatch.setattr(netsim.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    assert "tc" in netsim.preflight() and "iproute2" in netsim.preflight()


def _fake_mpiexec(tmp_path, banner):
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return str(path)


def test_mpi_flavour_from_the_version_banner(tmp_path):
    assert netsim.mpi_flavour(_fake_mpiexec(tmp_path, "HYDRA build details:")) == "mpich"
    assert netsim.mpi_flavour(_fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11")) == "openmpi"
    with pytest.raises(netsim.NetsimError, match="Hydra or Open MPI's prterun"):
        netsim.mpi_flavour(_fake_mpiexec(tmp_path, "some other launcher 1.0"))


def test_launch_commands_for_both_mpis(tmp_path):
    net = netsim.SimNet(2, 1e9, prefix="mpicomm-1-")
    net.workdir, net.launcher = str(tmp_path), str(tmp_path / "launch.sh")
    hydra = netsim.mpiexec_command(net, ["collectives"], "/x/mpiexec", 2, "mpich")
    i = hydra.index("/x/mpiexec")
    assert hydra[:i] == net.exec_prefix(0)
    assert hydra[i + 1:i + 9] == ["-launcher", "ssh", "-launcher-exec", net.launcher, "-hosts",
                                  "mpicomm-1-h0:2,mpicomm-1-h1:2", "-n", "4"]
    ompi = netsim.mpiexec_command(net, ["collectives"], "/x/mpiexec", 1, "openmpi")
    text = " ".join(ompi)
    for part in (f"--prtemca plm_ssh_agent {net.launcher}", "-n 2", "--mca pml ob1",
                 "--mca btl self,tcp", "--mca btl_tcp_if_include eth0", "-x MPICOMM_NETSIM_LINK"):
        assert part in text, text
    hostfile = ompi[ompi.index("--hostfile") + 1]
    assert open(hostfile).read() == "mpicomm-1-h0 slots=1\nmpicomm-1-h1 slots=1\n"
    env = netsim.launch_environment(net, "openmpi")
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env[netsim.LINK_ENV] == "eth0" and "MPIR_CVAR_NOLOCAL" not in env
    assert netsim.launch_environment(net, "mpich")["MPIR_CVAR_NOLOCAL"] == "1"
    assert "MPIR_CVAR_NOLOCAL" not in netsim.launch_environment(net, "mpich", ranks_per_host=2)


def test_link_meter_outside_netsim_and_on_loopback(monkeypatch, world):
    import socket

    monkeypatch.delenv(netsim.LINK_ENV, raising=False)
    assert netsim.link_tx_bytes() is None
    meter = netsim.LinkMeter(world)
    meter.start()
    assert meter.stop(1) is None
    monkeypatch.setenv(netsim.LINK_ENV, "nosuchlink0")
    with pytest.raises(netsim.NetsimError, match="nosuchlink0"):
        netsim.link_tx_bytes()
    # on the loopback link (shared with whatever else runs here, so a lower bound only)
    monkeypatch.setenv(netsim.LINK_ENV, "lo")
    meter = netsim.LinkMeter(world)
    meter.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(3):
            s.sendto(b"x" * 60000, ("127.0.0.1", 9))  # discard port: sent whether or not heard
    assert meter.stop(3) >= 60000


# ---------------------------------------------------------------------------------------------
# root, ip, tc and unshare needed

def _can_make_namespaces() -> str | None:
    problem = netsim.preflight()
    if problem:
        return problem
    probe = f"mpicomm-{os.getpid()}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create network namespaces here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_WHY_NOT = _can_make_namespaces()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def _mine(pid: int) -> list[str]:
    return netsim.leftovers(f"mpicomm-{pid}-")


def _ranks_running(pid: int) -> int:
    """How many Python processes below ``pid`` (the netsim driver) run the benchmark program."""
    parents, cmds = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmds[int(entry)] = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                pass

    def below(p: int) -> bool:
        seen = set()
        while p > 1 and p not in seen:
            seen.add(p)
            p = parents.get(p, 0)
            if p == pid:
                return True
        return False
    return sum(1 for p, argv in cmds.items() if os.path.basename(argv[0]).startswith(b"python")
               and b"collectives" in argv and b"netsim" not in argv and below(p))


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


@needs_netns
def test_simnet_up_connects_hosts_and_down_removes_everything():
    links_before = _root_links()
    net = netsim.SimNet(2, 1e9, prefix=f"mpicomm-{os.getpid()}-t1-")
    try:
        net.up()
        names = netsim.list_namespaces()
        assert set(net.host_names) | {net.switch} <= set(names)
        assert _root_links() == links_before, "links appeared in the root namespace"
        # host 1 listens, host 0 connects by host name: addresses and /etc/hosts work
        server = subprocess.Popen(net.exec_prefix(1) + [sys.executable, "-c", (
            "import socket,sys\n"
            "s=socket.create_server(('0.0.0.0',47001)); print('ready',flush=True)\n"
            "c,_=s.accept(); c.sendall(socket.gethostname().encode()); c.close()")],
            stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(net.exec_prefix(0) + [sys.executable, "-c", (
            "import socket,sys\n"
            f"c=socket.create_connection(('{net.host_names[1]}',47001),timeout=10)\n"
            "print(socket.gethostname(), c.recv(100).decode())")],
            capture_output=True, text=True, timeout=60)
        server.wait(timeout=30)
        assert client.returncode == 0, client.stderr
        assert client.stdout.split() == [net.host_names[0], net.host_names[1]]
        qdiscs = subprocess.run(["ip", "netns", "exec", net.host_names[0], "tc", "qdisc", "show",
                                 "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "rate 1Gbit" in qdiscs
        # no route leaves the namespace
        routes = subprocess.run(["ip", "-n", net.host_names[0], "route"], capture_output=True,
                                text=True).stdout
        assert "default" not in routes
    finally:
        net.down()
    assert netsim.leftovers(net.prefix) == []
    assert not os.path.exists(os.path.join(netns.NETNS_ETC, net.host_names[0]))


@needs_netns
def test_delay_uses_netem_or_says_it_is_missing():
    net = netsim.SimNet(2, 1e9, delay_s=1e-4, prefix=f"mpicomm-{os.getpid()}-t3-")
    try:
        try:
            net.up()
        except netsim.NetsimError as exc:
            assert "netem" in str(exc) and "without --delay" in str(exc)
        else:
            qdiscs = subprocess.run(["ip", "netns", "exec", net.host_names[0], "tc", "qdisc",
                                     "show", "dev", "eth0"], capture_output=True, text=True).stdout
            assert "netem" in qdiscs and "tbf" in qdiscs
    finally:
        net.down()
    assert netsim.leftovers(net.prefix) == []


@needs_netns
def test_failed_set_up_leaves_nothing(monkeypatch):
    net = netsim.SimNet(2, 1e9, prefix=f"mpicomm-{os.getpid()}-t2-")

    def broken_tc(*args, **kwargs):
        raise netsim.NetsimError("tc refused on purpose")

    monkeypatch.setattr(net, "_tc", broken_tc)
    with pytest.raises(netsim.NetsimError, match="on purpose"):
        net.up()
    assert netsim.leftovers(net.prefix) == []


@needs_netns
def test_cleanup_removes_namespaces_of_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = f"mpicomm-{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    os.makedirs(os.path.join(netns.NETNS_ETC, ns), exist_ok=True)
    removed = netsim.cleanup_stale()
    assert ns in removed
    assert _mine(dead.pid) == []


def _netsim(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "bench", "netsim", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@needs_netns
def test_collectives_across_two_hosts_at_the_link_rate(tmp_path):
    out = tmp_path / "ns.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "netsim", "--hosts", "2", "--rate", "100mbit", "--",
         "collectives", "--ops", "all_reduce,broadcast", "--peers", "mpi4py,gloo",
         "--sizes", "8,1M", "--iters", "3", "--warmup", "1", "--json", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert _mine(proc.pid) == []
    doc = json.loads(out.read_text())
    assert doc["meta"]["hosts"] == 2 and "netsim" in doc["meta"]["network"]
    recs = doc["records"]
    assert len(recs) == 8
    for rec in recs:
        assert common.validate_record(rec) == [], rec
        assert rec["hosts"] == 2 and rec["wrong"] == 0
    # a 1 MiB all_reduce on 100 Mbit/s (12.5 MB/s) links cannot beat the links; judged by the
    # slowest rank (a broadcast root may return before its data has left the socket buffers)
    big = [r for r in recs if r["op"] == "all_reduce" and r["size_bytes"] == 1 << 20]
    assert big and all(r["wire_bytes"] / r["time_us_max"] * 1e6 < 12.5e6 * 1.15 for r in big), big
    # the bytes counted on the links: the mpi4py allreduce sends the buffer once per rank
    mpi = next(r for r in big if r["peer"] == "mpi4py")
    assert mpi["wire_bytes"] <= mpi["wire_bytes_measured"] <= mpi["wire_bytes"] * 1.1, mpi


@pytest.mark.slow
@needs_netns
def test_bytes_counted_on_the_links_match_the_algorithms(tmp_path):
    # fp32 allreduce on 2 ranks: each sends the buffer once (reduce-scatter + allgather halves);
    # 1-bit: signs and a scale per chunk, ~32x fewer. Counted by the links' tx counters.
    out = tmp_path / "c.json"
    proc = _netsim("--hosts", "2", "--rate", "1gbit", "--", "compressed", "--sizes", "4M",
                   "--ops", "all_reduce,all_reduce:1bit", "--rounds", "1", "--iters", "3",
                   "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = {r["op"]: r for r in json.loads(out.read_text())["records"]}
    fp32, onebit = recs["all_reduce"], recs["all_reduce:1bit"]
    assert fp32["wire_bytes"] == 4 << 20
    for rec in (fp32, onebit):
        assert rec["wire_bytes"] <= rec["wire_bytes_measured"] <= rec["wire_bytes"] * 1.1 + 4096, rec
    ratio = fp32["wire_bytes_measured"] / onebit["wire_bytes_measured"]
    assert 25 < ratio < 33, ratio
    assert f"counted on the links fp32/1-bit {ratio:.1f}x" in proc.stdout


@pytest.mark.slow
@needs_netns
def test_two_hosts_two_ranks_each(tmp_path):
    out = tmp_path / "c.json"
    proc = _netsim("--hosts", "2", "--ranks-per-host", "2", "--rate", "1gbit", "--",
                   "collectives", "--ops", "all_reduce", "--peers", "mpi4py", "--sizes", "1M",
                   "--iters", "3", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks per host" in proc.stdout
    (rec,) = json.loads(out.read_text())["records"]
    assert (rec["ranks"], rec["hosts"], rec["wrong"]) == (4, 2, 0), rec
    # ranks of one host share memory: only part of each rank's traffic crosses the links
    assert 0.1 * rec["wire_bytes"] < rec["wire_bytes_measured"] < rec["wire_bytes"], rec


@pytest.mark.slow
@needs_netns
def test_hierarchical_one_bit_on_two_hosts_two_ranks_each(tmp_path):
    # MPI's shared-memory split sees the simulated hosts as nodes: the default is hierarchical,
    # right against the float64 simulation, and fewer bytes cross the links than flat
    out = tmp_path / "h.json"
    proc = _netsim("--hosts", "2", "--ranks-per-host", "2", "--rate", "1gbit", "--", "compressed",
                   "--sizes", "1M", "--ops", "all_reduce:1bit-flat,all_reduce:1bit-hier,all_reduce:1bit-ar",
                   "--rounds", "1", "--iters", "3", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "default algorithm: hierarchical: 2 nodes x 2 ranks" in proc.stdout
    recs = {r["op"]: r for r in json.loads(out.read_text())["records"]}
    assert all(r["wrong"] == 0 for r in recs.values()), recs
    flat, hier = recs["all_reduce:1bit-flat"], recs["all_reduce:1bit-hier"]
    assert hier["wire_bytes_measured"] <= 0.6 * flat["wire_bytes_measured"], (hier, flat)


@needs_netns
def test_failing_benchmark_still_tears_down():
    proc = subprocess.Popen([sys.executable, "-m", "bench", "netsim", "--hosts", "2", "--",
                             "collectives", "--ops", "scan"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "expected a comma list" in stderr
    assert _mine(proc.pid) == []


@needs_netns
def test_ctrl_c_tears_down():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "netsim", "--hosts", "3", "--rate", "100mbit", "--",
         "collectives", "--ops", "all_reduce", "--peers", "mpi4py", "--sizes", "64M",
         "--iters", "100"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("# netsim:"), first
        deadline = time.time() + 60  # until every host runs its rank of the benchmark
        while _ranks_running(proc.pid) < 3:
            assert time.time() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.01)
        assert _mine(proc.pid) != []
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert _mine(proc.pid) == []
