"""torch DCP interoperability: ``dcp.load`` through ``ckpt.DCPReader`` (plain and FSDP2 state
dicts, checksums, byte-range reads) and ``python -m ckpt convert --from dcp`` (1 and N ranks,
FSDP2 chunks, a hostile .metadata). References are the objects that were saved (or, for FSDP2,
their gathered ``full_tensor()``), never a read of the checkpoint under test."""
from __future__ import annotations

import datetime
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import ckpt
import mpicomm  # noqa: F401 - registers the "mpicomm" torch.distributed backend
from ckpt import cli as ckpt_cli
from ckpt.dcp_convert import read_dcp
from ckpt.dcp_reader import byte_runs
from conftest import single_process
from mpitest import assert_all, check_all

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "assuming single process" warnings


def make_model(seed: int, dims: tuple[int, ...] = (12, 16, 8, 3)) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    m = torch.nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def trained(seed: int = 0, steps: int = 2, dims: tuple[int, ...] = (12, 16, 8, 3)):
    """A model and AdamW after ``steps`` steps (every rank the same)."""
    model = make_model(seed, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, dims[0], generator=g)).pow(2).mean().backward()
        opt.step()
    return model, opt


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"], (sa["param_groups"], sb["param_groups"])
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def cli(*args: str) -> int:
    return ckpt_cli.main(list(args))


# -- byte runs of a box (pure) -----------------------------------------------------------------

def test_byte_runs_match_numpy_slicing():
    rng = np.random.default_rng(3)
    for _ in range(300):
        nd = int(rng.integers(0, 4))
        shape = tuple(int(s) for s in rng.integers(1, 6, nd))
        offsets = [int(rng.integers(0, s)) for s in shape]
        lengths = [int(rng.integers(0, s - o + 1)) for s, o in zip(shape, offsets)]
        full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].tobytes()
        starts, run = byte_runs(shape, offsets, lengths, 4)
        raw = full.tobytes()
        got = b"".join(raw[s:s + run] for s in starts.tolist())
        assert got == want, (shape, offsets, lengths)
        # runs are as long as the box allows: never more runs than the box's outer rows
        assert len(starts) <= max(1, int(np.prod(lengths[:-1])) if nd > 1 else 1)


# -- DCPReader, one process ---------------------------------------------------------------------

@single_process
def test_dcp_load_reads_model_and_optimizer(tmp_path):
    model, opt = trained()
    ckpt.save(tmp_path / "ck", model=model, optimizer=opt, step=2, comm=MPI.COMM_SELF, block_size=256,
              chunk_bytes=1024)
    # the layout get_state_dict builds: FQN keys for model and optimizer
    other = make_model(7)
    other_opt = torch.optim.AdamW(other.parameters(), lr=5.0)
    msd, osd = get_state_dict(other, other_opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=ckpt.DCPReader(tmp_path / "ck"))
    set_state_dict(other, other_opt, model_state_dict=msd, optim_state_dict=osd)
    same_model(model, other)
    same_optimizer(opt, other_opt)
    assert isinstance(other_opt.param_groups[0]["betas"], tuple)
    # a plain model.state_dict(), and the "optimizer" prefix
    plain = make_model(8)
    sd = plain.state_dict()
    dcp.load(sd, storage_reader=ckpt.DCPReader(tmp_path))  # through the parent's 'latest'
    plain.load_state_dict(sd)
    same_model(model, plain)
    third = make_model(9)
    third_opt = torch.optim.AdamW(third.parameters(), lr=5.0)
    msd, osd = get_state_dict(third, third_opt)
    dcp.load({"model": msd, "optimizer": osd}, storage_reader=ckpt.DCPReader(tmp_path / "ck"))
    set_state_dict(third, third_opt, model_state_dict=msd, optim_state_dict=osd)
    same_optimizer(opt, third_opt)


@single_process
def test_dcp_load_checks_the_blocks_it_reads(tmp_path):
    model, opt = trained()
    m = ckpt.save(tmp_path / "ck", model=model, optimizer=opt, comm=MPI.COMM_SELF, block_size=64, chunk_bytes=256)
    e = m.find("state", m.param_index()["2.weight"], "exp_avg")
    with open(tmp_path / "ck" / "data.bin", "r+b") as f:
        f.seek(e.offset + e.nbytes // 2)
        b = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    block = (e.offset + e.nbytes // 2) // 64
    other = make_model(7)
    other_opt = torch.optim.AdamW(other.parameters())
    msd, osd = get_state_dict(other, other_opt)
    with pytest.raises(CheckpointException) as info:  # DCP wraps every rank's failure in its own
        dcp.load({"model": msd, "optim": osd}, storage_reader=ckpt.DCPReader(tmp_path / "ck"))
    text = str(info.value)
    assert "ChecksumError" in text and "data.bin: checksum mismatch" in text and f"block {block} " in text, text
    assert "'2.weight' state exp_avg" in text, text
    # the model's weights lie in other blocks: they load, and the damaged block is never used
    sd = make_model(8).state_dict()
    reader = ckpt.DCPReader(tmp_path / "ck")
    dcp.load(sd, storage_reader=reader)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    weights = sum(m.find("param", i).nbytes for i in range(len(m.params)))
    assert reader.bytes_read <= weights + 2 * 64 * len(m.params), (reader.bytes_read, weights)


# -- convert --from dcp, one process -----------------------------------------------------------

@single_process
def test_convert_from_dcp_one_rank(tmp_path):
    model, opt = trained(seed=1)
    msd, osd = get_state_dict(model, opt)
    table = {"w": torch.arange(6.0).reshape(2, 3), "n": 3}
    dcp.save({"model": msd, "optim": osd, "step": 5, "table": table}, checkpoint_id=str(tmp_path / "dcp"))
    assert cli("convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ck")) == ckpt_cli.EXIT_OK
    other = make_model(9)
    other_opt = torch.optim.AdamW(other.parameters(), lr=3.0)
    got = {"w": torch.zeros(2, 3), "n": 0}
    res = ckpt.load(tmp_path / "ck", model=other, optimizer=other_opt, comm=MPI.COMM_SELF, state={"table": got})
    same_model(model, other)
    same_optimizer(opt, other_opt)
    assert res.step == 5 and torch.equal(got["w"], table["w"]) and res.state["table"]["n"] == 3
    # SGD, told from its state; a flat model state dict
    sgd_model = make_model(2)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    sgd_model(torch.ones(2, 12)).sum().backward()
    sgd.step()
    msd, osd = get_state_dict(sgd_model, sgd)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp-sgd"))
    ckpt.from_dcp(tmp_path / "dcp-sgd", tmp_path / "ck-sgd", comm=MPI.COMM_SELF)
    back = make_model(3)
    back_sgd = torch.optim.SGD(back.parameters(), lr=0.5, momentum=0.1)
    ckpt.load(tmp_path / "ck-sgd", model=back, optimizer=back_sgd, comm=MPI.COMM_SELF)
    same_model(sgd_model, back)
    same_optimizer(sgd, back_sgd)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp-flat"))
    ckpt.from_dcp(tmp_path / "dcp-flat", tmp_path / "ck-flat", comm=MPI.COMM_SELF)
    flat = make_model(4)
    ckpt.load(tmp_path / "ck-flat", model=flat, comm=MPI.COMM_SELF)
    same_model(model, flat)


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@single_process
def test_hostile_metadata_is_refused_without_running(tmp_path, capsys):
    model, _ = trained()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    marker = tmp_path / "PWNED"
    real = (tmp_path / "dcp" / ".metadata").read_bytes()
    for protocol in (2, 4):
        (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(str(marker)), protocol=protocol))
        with pytest.raises(ckpt.PickleRefusedError, match=r"\.metadata holds the global posix\.system"):
            read_dcp(tmp_path / "dcp")
        code = cli("convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / f"out{protocol}"))
        err = capsys.readouterr().err
        assert code == ckpt_cli.EXIT_PICKLE and "posix.system" in err, err
        assert not marker.exists(), "the payload ran"
    # a damaged data file is named
    (tmp_path / "dcp" / ".metadata").write_bytes(real)
    data = tmp_path / "dcp" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 7, len(raw), len(raw) // 7):  # some land in zip padding, which no CRC covers
        raw[i] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="__0_0.distcp"):
        read_dcp(tmp_path / "dcp")


# -- several ranks: FSDP2 ----------------------------------------------------------------------

@pytest.fixture
def process_group(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def fsdp(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.mpi(min_size=1)
def test_dcp_load_into_fsdp2_from_a_plain_checkpoint(process_group, world, shared_tmp_path):
    dims = (64, 128, 64)  # 200 KB of weights and AdamW state: a shard is much less than the whole
    model, opt = trained(seed=3, dims=dims)  # the same on every rank
    ckpt.save(shared_tmp_path / "ck", model=model, optimizer=opt, comm=world, block_size=128, chunk_bytes=512)
    sharded = fsdp(make_model(11, dims))
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=4.0)
    msd, osd = get_state_dict(sharded, sharded_opt)
    reader = ckpt.DCPReader(shared_tmp_path / "ck")
    dcp.load({"model": msd, "optim": osd}, storage_reader=reader)
    set_state_dict(sharded, sharded_opt, model_state_dict=msd, optim_state_dict=osd)
    ref = dict(model.named_parameters())
    local_bytes = 0

    def check():
        nonlocal local_bytes
        for name, p in sharded.named_parameters():
            assert torch.equal(_full(p.detach()), ref[name].detach()), name
            local_bytes += p._local_tensor.numel() * 4 if hasattr(p, "_local_tensor") else p.numel() * 4
        _, got = get_state_dict(sharded, sharded_opt)
        want = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        for i, name in enumerate(names):
            for k, v in want["state"][i].items():
                assert torch.equal(_full(got["state"][name][k]), v), (name, k)
        for g, w in zip(got["param_groups"], want["param_groups"]):
            assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in w.items() if k != "params"}
    check_all(check)
    # each rank read its shards (weights, exp_avg, exp_avg_sq) and the blocks around them, not whole tensors
    nparams = len(list(model.parameters()))
    bound = 3 * local_bytes + 3 * nparams * 2 * 128
    whole = 3 * 4 * sum(p.numel() for p in model.parameters())
    assert_all(reader.bytes_read <= bound, f"read {reader.bytes_read} bytes, bound {bound} (all of it: {whole})")


@pytest.mark.mpi(min_size=1)
def test_convert_dcp_saved_from_fsdp2(process_group, world, comm, shared_tmp_path):
    model = fsdp(make_model(5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(60 + world.rank)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 12, generator=g)).pow(2).mean().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=str(shared_tmp_path / "dcp"))
    # the references, gathered by DTensor before the conversion
    full_w = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    full_s = {n: {k: _full(v).clone() for k, v in st.items()} for n, st in osd["state"].items()}
    world.Barrier()
    ckpt.from_dcp(shared_tmp_path / "dcp", shared_tmp_path / "ck", comm=comm)
    plain = make_model(6)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=9.0)
    res = ckpt.load(shared_tmp_path / "ck", model=plain, optimizer=plain_opt, comm=MPI.COMM_SELF)

    def check():
        assert res.step == 2
        names = [n for n, _ in plain.named_parameters()]
        for n, p in plain.named_parameters():
            assert torch.equal(p.detach(), full_w[n]), n
        st = plain_opt.state_dict()["state"]
        for i, n in enumerate(names):
            for k, v in full_s[n].items():
                assert torch.equal(st[i][k], v), (n, k)
        assert plain_opt.param_groups[0]["lr"] == 0.01
    check_all(check)
