"""ckpt save/load on the world communicator: exact resume, plain optimizers, the on-disk format,
checksums and crash safety."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
import mpicomm
from ckpt import api as ckpt_api
from mpitest import assert_all, check_all

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4)).to(dtype)


def train(model, opt, steps, rank, dtype=torch.float32):
    for s in steps:
        g = torch.Generator().manual_seed(1000 * s + rank)
        x, y = torch.randn(3, 5, generator=g).to(dtype), torch.randn(3, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()


def shard_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    out = []
    for gi, g in enumerate(opt.groups):
        out.append(g.master)
        out += [v if isinstance(v, torch.Tensor) else torch.tensor(v) for _, v in sorted(opt.shard_state(gi).items())]
    return out


def equal_states(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# -- resume at the same world size is bit-identical -------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_resume_continues_bit_identically(comm, world, shared_tmp_path, dtype_name, stage, opt_name):
    dtype = DTYPES[dtype_name]
    cls, kw = OPTIMIZERS[opt_name]
    path = str(shared_tmp_path / "ck")

    straight = make_model(dtype)
    opt = ZeroOptimizer(cls, straight.parameters(), stage=stage, comm=comm, **kw)
    train(straight, opt, range(16), comm.rank, dtype)
    expected = shard_tensors(opt)

    first = make_model(dtype)
    opt1 = ZeroOptimizer(cls, first.parameters(), stage=stage, comm=comm, **kw)
    train(first, opt1, range(8), comm.rank, dtype)
    ckpt.save(path, model=first, optimizer=opt1, step=8, comm=comm)

    resumed = make_model(dtype, seed=7)
    opt2 = ZeroOptimizer(cls, resumed.parameters(), stage=stage, comm=comm, **kw)
    info = ckpt.load(path, model=resumed, optimizer=opt2, comm=comm)
    train(resumed, opt2, range(info.step, 16), comm.rank, dtype)

    def check():
        for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(a, b), f"model {k} differs after resume"
        assert equal_states(shard_tensors(opt2), expected), "optimizer shard differs after resume"

    check_all(check, world)


# -- plain (unsharded) torch optimizers -------------------------------------------------------

def full_state_of_zero(opt: ZeroOptimizer, comm) -> dict[int, dict[str, torch.Tensor]]:
    """Per-parameter state gathered and unpadded with plain slicing (stage 1 only)."""
    assert opt.stage == 1
    out: dict[int, dict[str, torch.Tensor]] = {}
    pos = 0
    for gi, g in enumerate(opt.groups):
        local = g.master.numel()
        for key, v in opt.shard_state(gi).items():
            if not (isinstance(v, torch.Tensor) and v.dim() == 1):
                for j in range(len(g.params)):
                    out.setdefault(pos + j, {})[key] = v
                continue
            full = torch.empty(comm.size * local, dtype=v.dtype)
            comm.all_gather_into_tensor(full, v)
            off = 0
            for j, p in enumerate(g.params):
                out.setdefault(pos + j, {})[key] = full[off:off + p.numel()].view(p.shape)
                off += p.numel()
        pos += len(g.params)
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("opt_name", ["adam", "adamw"])
def test_zero_to_plain_and_back(comm, world, shared_tmp_path, opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    model = make_model()
    zero = ZeroOptimizer(cls, model.parameters(), stage=1, comm=comm, **kw)
    train(model, zero, range(5), comm.rank)
    ckpt.save(shared_tmp_path / "a", model=model, optimizer=zero, step=5, comm=comm)
    expected = full_state_of_zero(zero, comm)

    plain_model = make_model(seed=3)
    plain = cls(plain_model.parameters(), **{**kw, "lr": 1.0})
    ckpt.load(shared_tmp_path / "a", model=plain_model, optimizer=plain, comm=comm)
    sd = plain.state_dict()

    def check_plain():
        assert sd["param_groups"][0]["lr"] == kw["lr"]
        assert sorted(sd["state"]) == sorted(expected), f"{sorted(sd['state'])} != {sorted(expected)}"
        for i, st in expected.items():
            assert set(sd["state"][i]) == set(st), f"param {i}: keys {set(sd['state'][i])} != {set(st)}"
            for k, v in st.items():
                assert torch.equal(sd["state"][i][k], v), f"param {i} {k} differs"
        for a, b in zip(model.state_dict().values(), plain_model.state_dict().values()):
            assert torch.equal(a, b)

    check_all(check_plain, world)

    # the plain optimizer's replicated state, saved by all ranks together, back into ZeRO-3
    train(plain_model, plain, range(5, 7), 0)
    ckpt.save(shared_tmp_path / "b", model=plain_model, optimizer=plain, step=7, comm=comm)
    back_model = make_model(seed=4)
    back = ZeroOptimizer(cls, back_model.parameters(), stage=2, comm=comm, **kw)
    ckpt.load(shared_tmp_path / "b", model=back_model, optimizer=back, comm=comm)
    sd = plain.state_dict()

    def check_back():
        for a, b in zip(plain_model.state_dict().values(), back_model.state_dict().values()):
            assert torch.equal(a, b)
        for gi, g in enumerate(back.groups):
            for key, v in back.shard_state(gi).items():
                if not (isinstance(v, torch.Tensor) and v.dim() == 1):
                    assert float(v) == float(sd["state"][0][key])
                    continue
                for s in g.layout.segments(comm.rank):
                    want = sd["state"][s.param][key].reshape(-1)[s.start:s.start + s.length]
                    assert torch.equal(v[s.local:s.local + s.length], want), f"{key} of param {s.param}"

    check_all(check_back, world)


# -- the on-disk format ---------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_format_is_canonical_json_and_raw_bytes(comm, world, shared_tmp_path):
    model = make_model(torch.bfloat16)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=comm, lr=0.01)
    train(model, opt, range(3), comm.rank, torch.bfloat16)
    ckpt.save(shared_tmp_path / "c", model=model, optimizer=opt, step=3, comm=comm,
              extra={"note": "hi"}, block_size=64, chunk_bytes=128)
    d = shared_tmp_path / "c"

    def check():
        with open(d / "manifest.json") as f:
            m = json.load(f)  # plain JSON
        data = (d / "data.bin").read_bytes()
        assert m["format"] == "mpicomm-ckpt" and m["version"] == ckpt.FORMAT_VERSION
        assert (m["world_size"], m["stage"], m["step"], m["extra"]) == (comm.size, 2, 3, {"note": "hi"})
        sd = model.state_dict()
        assert [(p["name"], p["shape"], p["dtype"]) for p in m["params"]] == \
            [(k, list(v.shape), "bfloat16") for k, v in sd.items()]
        assert m["optimizer"]["class"] == "torch.optim.adam.Adam"
        # a safetensors header (8-byte length, JSON padded to 8), then every byte belongs to
        # exactly one tensor: no padding, no gaps
        head = int.from_bytes(data[:8], "little")
        assert head % 8 == 0 and json.loads(data[8:8 + head])["__metadata__"] == {"format": "pt"}
        spans = sorted({(t["offset"], t["nbytes"]) for t in m["tensors"]})
        pos = 8 + head
        for off, n in spans:
            assert off == pos, f"gap or overlap at {pos}"
            pos += n
        assert pos == len(data) == m["files"]["data.bin"]["nbytes"]
        kinds = {(t["kind"], t["key"]) for t in m["tensors"]}
        assert kinds == {("param", None), ("master", None), ("state", "exp_avg"), ("state", "exp_avg_sq")}
        # raw little-endian tensor bytes at their offsets
        for t in m["tensors"]:
            raw = data[t["offset"]:t["offset"] + t["nbytes"]]
            if t["kind"] == "param":
                want = sd[t["name"]].view(torch.int16).numpy().tobytes()
                assert raw == want, f"bytes of {t['name']}"
            if t["kind"] == "master":
                want = sd[t["name"]].float()
                got = torch.from_numpy(np.frombuffer(raw, np.float32).copy()).view(want.shape)
                assert (got - want).abs().max() <= want.abs().max() * 2 ** -7, t["name"]
        # block checksums, recomputed here with zlib
        bs = m["block_size"]
        assert m["files"]["data.bin"]["crc32"] == [zlib.crc32(data[i:i + bs]) for i in range(0, len(data), bs)]
        assert not data.startswith(b"\x80"), "looks like a pickle"

    check_all(check, world)


@pytest.mark.mpi(min_size=1)
def test_buffers_and_tied_weights_round_trip(comm, world, shared_tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 11))
        m[2].weight = m[0].weight  # tied
        return m

    model = build(0)
    model.train()
    model(torch.arange(8) % 11)  # updates BatchNorm running stats and num_batches_tracked
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), stage=1, comm=comm, lr=0.1, momentum=0.5)
    opt.zero_grad()
    model(torch.arange(5)).sum().backward()
    opt.step()
    ckpt.save(shared_tmp_path / "t", model=model, optimizer=opt, step=1, comm=comm)

    for with_opt in (True, False):
        other = build(9)
        opt2 = ZeroOptimizer(torch.optim.SGD, other.parameters(), stage=2, comm=comm, lr=0.1,
                                  momentum=0.5) if with_opt else None
        ckpt.load(shared_tmp_path / "t", model=other, optimizer=opt2, comm=comm)

        def check():
            assert other[2].weight is other[0].weight
            for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
                assert a.dtype == b.dtype and torch.equal(a, b), k

        check_all(check, world)


# -- checksums --------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_corruption_is_detected_in_the_bytes_read(comm, world, shared_tmp_path):
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=0.01)
    train(model, opt, range(2), comm.rank)
    path = shared_tmp_path / "k"
    m = ckpt.save(path, model=model, optimizer=opt, step=2, comm=comm, block_size=64, chunk_bytes=64)
    victim = m.find("state", len(m.params) - 1, "exp_avg_sq")  # last tensor, its own blocks
    if comm.rank == 0:
        with open(path / "data.bin", "r+b") as f:
            f.seek(victim.offset + victim.nbytes - 1)
            b = f.read(1)
            f.seek(victim.offset + victim.nbytes - 1)
            f.write(bytes([b[0] ^ 0x10]))
    world.Barrier()
    # a model-only load does not read the damaged block
    ckpt.load(path, model=make_model(seed=1), comm=comm)
    caught = None
    m2 = make_model(seed=1)
    try:
        ckpt.load(path, model=m2, optimizer=ZeroOptimizer(torch.optim.Adam, m2.parameters(), comm=comm),
                  comm=comm)
    except ckpt.ChecksumError as exc:
        caught = str(exc)
    except Exception as exc:  # noqa: BLE001
        caught = f"wrong error {type(exc).__name__}: {exc}"
    assert_all(caught is not None and "checksum mismatch" in caught, f"got {caught!r}")


# -- crash safety -------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
def test_interrupted_save_never_looks_complete(comm, world, shared_tmp_path, monkeypatch):
    model = make_model()
    root = shared_tmp_path / "run"
    ckpt.save(root / "step1", model=model, step=1, comm=comm)

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt.checksum, "blocks_from_parts", boom)  # fails after the data is written
    with pytest.raises(OSError, match="simulated"):
        ckpt.save(root / "step2", model=make_model(seed=5), step=2, comm=comm)
    monkeypatch.undo()

    def check():
        assert not (root / "step2").exists()
        leftovers = [p for p in os.listdir(root) if ".tmp-" in p]
        assert leftovers, "expected the interrupted save's temporary directory"
        assert (root / "latest").read_text().strip() == "step1"
        assert ckpt.resolve(root) == str(root / "step1")
        # the temporary directory has data but no manifest: never a checkpoint
        with pytest.raises(ckpt.ManifestError):
            ckpt.read_manifest(root / leftovers[0])

    check_all(check, world)
    info = ckpt.load(root, model=make_model(seed=3), comm=comm)  # follows latest
    assert_all(info.step == 1, f"step {info.step}")

    # a truncated data file is refused
    ckpt.save(root / "step3", model=model, step=3, comm=comm)
    world.Barrier()
    if comm.rank == 0:
        with open(root / "step3" / "data.bin", "r+b") as f:
            f.truncate(10)
    world.Barrier()
    with pytest.raises(ckpt.ManifestError, match="expected .* bytes"):
        ckpt.load(root, model=make_model(), comm=comm)


@pytest.mark.mpi(min_size=1)
def test_overwrite_and_latest(comm, world, shared_tmp_path):
    root = shared_tmp_path / "ow"
    ckpt.save(root / "a", model=make_model(seed=1), step=1, comm=comm)
    with pytest.raises(FileExistsError):
        ckpt.save(root / "a", model=make_model(seed=2), step=2, comm=comm)
    ckpt.save(root / "a", model=make_model(seed=2), step=2, comm=comm, overwrite=True)
    ckpt.save(root / "b", model=make_model(seed=3), step=3, comm=comm, update_latest=False)
    assert ckpt.load(root, model=make_model(), comm=comm).step == 2
    model = make_model()
    assert ckpt.load(root / "b", model=model, comm=comm).step == 3
    assert_all(all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                       make_model(seed=3).state_dict().values())))
    assert_all(not [p for p in os.listdir(root) if ".old-" in p or ".tmp-" in p])


@pytest.mark.mpi(min_size=1)
def test_load_rejects_mismatches(comm, shared_tmp_path):
    path = shared_tmp_path / "mm"
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=0.01)
    train(model, opt, range(1), comm.rank)
    ckpt.save(path, model=model, optimizer=opt, step=1, comm=comm)
    wrong = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="expected shape"):
        ckpt.load(path, model=wrong, comm=comm)
    with pytest.raises(TypeError, match="Adam state, the optimizer is torch.optim.sgd.SGD"):
        m2 = make_model()
        ckpt.load(path, model=m2, optimizer=ZeroOptimizer(torch.optim.SGD, m2.parameters(), comm=comm, lr=1),
                  comm=comm)
    with pytest.raises(KeyError, match="missing"):
        ckpt.load(path, model=torch.nn.Sequential(torch.nn.Linear(5, 7)), comm=comm)


# -- tensors over 2 GiB (opt-in: needs about 10 GiB of memory and disk) ------------------------------

@pytest.mark.slow
@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not os.environ.get("MPICOMM_CKPT_BIG"), reason="set MPICOMM_CKPT_BIG=1 (about 10 GiB)")
def test_tensor_over_2gib(comm, world, shared_tmp_path):
    n = (1 << 29) + 3  # 2 GiB + 12 bytes of float32

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Parameter(torch.zeros(n))
            self.small = torch.nn.Parameter(torch.zeros(5))

    model = Big()
    with torch.no_grad():
        model.big[::1 << 20] = torch.arange(len(range(0, n, 1 << 20)), dtype=torch.float32)
        model.big[-1] = 7.0
        model.small.copy_(torch.arange(5.0))
    m = ckpt.save(shared_tmp_path / "big", model=model, step=0, comm=comm)
    assert_all(m.find("param", 1).offset > 2 ** 31)
    other = Big()
    ckpt.load(shared_tmp_path / "big", model=other, comm=comm)
    assert_all(torch.equal(other.big, model.big) and torch.equal(other.small, model.small))


# -- command line -------------------------------------------------------------------------------------

def test_cli_inspect_and_verify(tmp_path):
    import subprocess
    import sys

    comm = MPI.COMM_SELF  # a one-rank save inside this process; mpi4py communicators are accepted
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=mpicomm.as_communicator(comm), lr=0.01)
    train(model, opt, range(2), 0)
    ckpt.save(tmp_path / "c", model=model, optimizer=opt, step=2, comm=comm, extra={"epoch": 1})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "ckpt", *args], cwd=root, capture_output=True, text=True,
                              timeout=120)

    out = cli("inspect", str(tmp_path), "--tensors")  # follows the latest pointer
    assert out.returncode == 0, out.stderr
    assert "stage 2, step 2" in out.stdout and "torch.optim.adam.Adam" in out.stdout
    assert "exp_avg_sq" in out.stdout and '"epoch": 1' in out.stdout
    assert cli("verify", str(tmp_path / "c")).returncode == 0
    with open(tmp_path / "c" / "data.bin", "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 1]))
    out = cli("verify", str(tmp_path / "c"))
    assert out.returncode == 1 and "BAD: 1 of 1 blocks" in out.stdout, out.stdout
    out = cli("inspect", str(tmp_path / "nothing"))
    assert out.returncode == 2 and "no checkpoint" in out.stderr


@pytest.mark.mpi(min_size=1)
def test_low_precision_plain_checkpoint_into_zero(comm, world, shared_tmp_path):
    model = make_model(torch.bfloat16)
    plain = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, plain, range(3), 0, torch.bfloat16)  # same data on every rank: replicated state
    ckpt.save(shared_tmp_path / "p", model=model, optimizer=plain, step=3, comm=comm)

    other = make_model(torch.bfloat16, seed=5)
    zero = ZeroOptimizer(torch.optim.SGD, other.parameters(), stage=2, comm=comm, lr=0.05, momentum=0.9)
    ckpt.load(shared_tmp_path / "p", model=other, optimizer=zero, comm=comm)
    params = list(model.parameters())

    def check():
        for a, b in zip(model.state_dict().values(), other.state_dict().values()):
            assert torch.equal(a, b)
        g = zero.groups[0]
        buf = zero.shard_state(0)["momentum_buffer"]
        assert buf.dtype == torch.float32
        for s in g.layout.segments(comm.rank):
            want_w = params[s.param].detach().reshape(-1)[s.start:s.start + s.length].float()
            want_m = plain.state[params[s.param]]["momentum_buffer"].reshape(-1)[s.start:s.start + s.length].float()
            assert torch.equal(g.master[s.local:s.local + s.length], want_w)
            assert torch.equal(buf[s.local:s.local + s.length], want_m)

    check_all(check, world)
    train(other, zero, range(3, 5), comm.rank, torch.bfloat16)  # and it trains on


# -- who moves which bytes -------------------------------------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stage", [1, 2])
def test_every_byte_written_once_and_each_rank_reads_its_own(comm, world, shared_tmp_path, monkeypatch, stage):
    model = make_model(torch.bfloat16)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=stage, comm=comm, lr=0.01)
    train(model, opt, range(2), comm.rank, torch.bfloat16)
    seen = {}
    real_write, real_read = ckpt_api.write_items, ckpt_api.read_items

    def spy_write(mpi_comm, filename, items, *a, **k):
        seen["write"] = [(it.offset, it.nbytes) for it in items]
        return real_write(mpi_comm, filename, items, *a, **k)

    def spy_read(mpi_comm, filename, items, *a, **k):
        seen["read"] = [(it.offset, it.nbytes) for it in items]
        return real_read(mpi_comm, filename, items, *a, **k)

    monkeypatch.setattr(ckpt_api, "write_items", spy_write)
    monkeypatch.setattr(ckpt_api, "read_items", spy_read)
    m = ckpt.save(shared_tmp_path / "w", model=model, optimizer=opt, step=2, comm=comm)
    other = make_model(torch.bfloat16, seed=3)
    opt2 = ZeroOptimizer(torch.optim.Adam, other.parameters(), stage=3 - stage,
                              comm=comm, lr=0.01)
    ckpt.load(shared_tmp_path / "w", model=other, optimizer=opt2, comm=comm)
    writes = world.allgather(seen["write"])
    size = m.files["data.bin"]["nbytes"]

    def check():
        counts = np.zeros(size, np.int64)
        for lst in writes:
            for off, n in lst:
                counts[off:off + n] += 1
        assert (counts == 1).all(), f"bytes written {counts.min()}..{counts.max()} times"
        # this rank read exactly its own shard of masters and optimizer state, nothing else
        want = np.zeros(size, np.int64)
        g = opt2.groups[0]
        for kind, key in (("master", None), ("state", "exp_avg"), ("state", "exp_avg_sq")):
            for s in g.layout.segments(comm.rank):
                e = m.find(kind, s.param, key)
                want[e.offset + s.start * 4:e.offset + (s.start + s.length) * 4] += 1
        got = np.zeros(size, np.int64)
        for off, n in seen["read"]:
            got[off:off + n] += 1
        assert (got == want).all(), f"read {int(got.sum())} bytes, own shard is {int(want.sum())}"

    check_all(check, world)
