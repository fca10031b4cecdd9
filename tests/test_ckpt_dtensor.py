"""DTensor layouts (pure: compared with torch's own sharding), bad DTensor input (a clear error on
every rank, never a hang), memory of a sharded load, and the tools that work on every checkpoint
(inspect, verify, export, DeepSpeed import and export, checksums) on FSDP2 checkpoints."""
from __future__ import annotations

import datetime
import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import ckpt
import mpicomm  # noqa: F401 - registers the backend
from ckpt import dtensor_layout as dl
from mpitest import assert_all, check_all

# -- layouts (pure) ----------------------------------------------------------------------------

CASES = [
    ((7, 5), (3,), [Shard(0)]),
    ((7, 5), (4,), [Shard(1)]),
    ((2, 9, 4), (3,), [Shard(1)]),
    ((2, 9, 4), (2, 2), [Shard(2), Shard(1)]),
    ((6, 6), (2, 3), [Shard(0), Shard(0)]),
    ((5, 7), (2, 2), [Replicate(), Shard(1)]),
    ((9, 4), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((8, 6), (2, 2), [_StridedShard(1, split_factor=2), Shard(1)]),
    ((3,), (4,), [Shard(0)]),
    ((), (2,), [Replicate()]),
]


@pytest.mark.parametrize("shape,mesh,placements", CASES, ids=[str(i) for i in range(len(CASES))])
def test_layout_matches_torch(shape, mesh, placements):
    """Local shapes and first offsets equal torch's; the runs gather exactly the elements that
    torch's chunking (torch.chunk per Shard, in mesh order) gives each coordinate."""
    numel = math.prod(shape)
    boxes = []
    for coord in itertools.product(*(range(n) for n in mesh)):
        lay = dl.layout(shape, mesh, coord, placements)
        want_shape, want_off = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert dl.local_shape(lay) == tuple(want_shape), coord
        if dl.volume(lay):
            assert tuple(r[0][0] for r in lay) == tuple(want_off), coord
        flat = torch.arange(numel, dtype=torch.int64)
        got = torch.cat([flat[f:f + n] for f, _lo, n in dl.runs(shape, lay)]) if dl.volume(lay) else flat[:0]
        if not any(isinstance(p, _StridedShard) for p in placements):
            idx = flat.reshape(shape)
            for p, c, n in zip(placements, coord, mesh):
                if isinstance(p, Shard):
                    pieces = torch.chunk(idx, n, dim=p.dim)
                    idx = pieces[c] if c < len(pieces) else idx.narrow(p.dim, 0, 0)
            assert torch.equal(got, idx.reshape(-1)), coord
        if not any(isinstance(p, Replicate) for p in placements) and dl.volume(lay):
            boxes.append(lay)
    s = dl.Sharding(tuple(shape), tuple(mesh), tuple(range(math.prod(mesh))), tuple(placements), None)
    dl.check_cover(shape, s.boxes())
    if boxes:
        assert sorted(map(str, boxes)) == sorted(map(str, s.boxes()))


def test_runs_local_offsets_follow_the_local_tensor():
    lay = dl.layout((4, 6), (3,), (1,), [Shard(1)])
    assert lay == [[(0, 4)], [(2, 4)]]
    assert dl.runs((4, 6), lay) == [(2, 0, 2), (8, 2, 2), (14, 4, 2), (20, 6, 2)]
    assert dl.runs((4, 6), dl.layout((4, 6), (2,), (1,), [Shard(0)])) == [(12, 0, 12)]


def test_check_cover_refuses_gaps_and_overlaps():
    with pytest.raises(dl.PlacementError, match="hold 6 elements"):
        dl.check_cover((4, 2), [[[(0, 3)], [(0, 2)]]])
    with pytest.raises(dl.PlacementError, match="overlap"):
        dl.check_cover((4, 2), [[[(0, 3)], [(0, 2)]], [[(2, 3)], [(0, 2)]]])


# -- jobs with a process group -----------------------------------------------------------------

@pytest.fixture(scope="module")
def pg(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def fsdp_model(mesh, rows=7, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, rows), torch.nn.Tanh(), torch.nn.Linear(rows, 3))
    fully_shard(m, mesh=mesh)
    return m


def trained(mesh, comm):
    m = fsdp_model(mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    m(torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))).sum().backward()
    opt.step()
    return m, opt


def raises_everywhere(fn, cls, match):
    """``fn`` raises ``cls`` matching ``match`` on this rank (checked collectively)."""
    def check():
        with pytest.raises(cls, match=match):
            fn()
    check_all(check)


@pytest.mark.mpi(min_size=1)
def test_partial_is_refused_by_name(pg, comm, shared_tmp_path):
    mesh = init_device_mesh("cpu", (comm.size,))
    part = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    raises_everywhere(lambda: ckpt.save(str(shared_tmp_path / "p"), model=torch.nn.Linear(1, 1), comm=comm,
                                        state={"x": {"sum": part}}),
                      ckpt.IncompatibleStateError, r"Partial.*cannot be saved or loaded")
    m = torch.nn.Linear(3, 1)
    m.bias = torch.nn.Parameter(DTensor.from_local(torch.ones(1), mesh, [Partial()], run_check=False))
    raises_everywhere(lambda: ckpt.save(str(shared_tmp_path / "q"), model=m, comm=comm),
                      ckpt.IncompatibleStateError, r"'bias'.*placement P\(sum\) \(Partial\)")
    assert_all(not os.path.exists(shared_tmp_path / "p") and not os.path.exists(shared_tmp_path / "q"), "nothing")


@pytest.mark.mpi(min_size=2)
def test_mesh_outside_the_communicator_is_refused(pg, comm, world, shared_tmp_path):
    mesh = init_device_mesh("cpu", (comm.size,))
    m, opt = trained(mesh, comm)
    path = str(shared_tmp_path / "ck")
    ckpt.save(path, model=m, optimizer=opt, comm=comm)
    solo = comm.split(0 if comm.rank == 0 else None)
    if solo is not None:
        for fn in (lambda: ckpt.save(path + "2", model=m, optimizer=opt, comm=solo),
                   lambda: ckpt.load(path, model=m, optimizer=opt, comm=solo)):
            with pytest.raises(ckpt.IncompatibleStateError, match=r"'0.weight' is a DTensor on a device mesh over "
                                                                  r"process-group ranks \[0, 1.*outside"):
                fn()
        solo.free()
    world.Barrier()


@pytest.mark.mpi(min_size=2)
def test_global_shapes_that_disagree_are_refused(pg, comm, shared_tmp_path):
    """Every rank's shard fits the global shape it was given, but the ranks were given different
    shapes: refused before any byte is written, naming each rank's shape."""
    mesh = init_device_mesh("cpu", (comm.size,))
    w = comm.size
    shape = (3 * w - 1, 4) if comm.rank == w - 1 else (2 * w, 4)
    bad = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                             stride=(4, 1))
    m = torch.nn.Linear(1, 1)
    m.weight = torch.nn.Parameter(bad)
    raises_everywhere(lambda: ckpt.save(str(shared_tmp_path / "ck"), model=m, comm=comm),
                      ckpt.IncompatibleStateError, rf"disagree on the global shape.*'weight'.*rank 0: 'weight' shape "
                                                   rf"\[{2 * w}, 4\].*rank {w - 1}: 'weight' shape \[{3 * w - 1}, 4\]")
    odd = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False,
                             shape=torch.Size((2 * w + (comm.rank == 0), 4)), stride=(4, 1))
    m.weight = torch.nn.Parameter(odd)
    raises_everywhere(lambda: ckpt.save(str(shared_tmp_path / "ck"), model=m, comm=comm),
                      ckpt.IncompatibleStateError, r"should hold a local shard of shape")


@pytest.mark.mpi(min_size=1)
def test_load_into_other_dtensor_shapes_lists_them(pg, comm, shared_tmp_path):
    mesh = init_device_mesh("cpu", (comm.size,))
    m, opt = trained(mesh, comm)
    ckpt.save(str(shared_tmp_path / "ck"), model=m, optimizer=opt, comm=comm)
    other = fsdp_model(mesh, rows=8)
    raises_everywhere(lambda: ckpt.load(str(shared_tmp_path / "ck"), model=other, comm=comm),
                      ckpt.StateMismatchError, r"other shapes \(3\): '0.weight' expected shape \(8, 5\), checkpoint "
                                               r"has \(7, 5\), '0.bias' expected shape \(8,\).*'2.weight'")
    res = ckpt.load(str(shared_tmp_path / "ck"), model=other, comm=comm, strict=False)
    assert_all(sorted(res.mismatched) == ["0.bias", "0.weight", "2.weight"], str(res.mismatched))
    assert_all(torch.equal(other[2].bias.full_tensor(), m[2].bias.full_tensor()), "2.bias loaded")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.mpi(min_size=2)
def test_sharded_load_reads_only_its_shard(pg, comm, shared_tmp_path):
    """Peak RSS growth of a load into an FSDP2 model stays within this rank's shard + 64 MiB; a
    tensor materialised whole (192 MiB) would not fit."""
    mesh = init_device_mesh("cpu", (comm.size,))
    rows, cols = 6144, 8192  # 192 MiB of fp32

    def build():
        with torch.device("meta"):
            m = torch.nn.Linear(cols, rows, bias=False)
        fully_shard(m, mesh=mesh)
        m.to_empty(device="cpu")
        return m

    m = build()
    with torch.no_grad():
        m.weight._local_tensor.uniform_(generator=torch.Generator().manual_seed(comm.rank))
    path = str(shared_tmp_path / "big")
    ckpt.save(path, model=m, comm=comm, sync=False)
    m2 = build()
    with torch.no_grad():
        m2.weight._local_tensor.zero_()
    shard = m2.weight._local_tensor.numel() * 4
    full = rows * cols * 4
    assert full > shard + (64 << 20)  # the bound tells a whole tensor from a shard
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM)
    before = _rss_kib("VmRSS")
    ckpt.load(path, model=m2, comm=comm)
    growth = (_rss_kib("VmHWM") - before) * 1024
    assert_all(growth <= shard + (64 << 20), f"peak RSS grew {growth >> 20} MiB; shard {shard >> 20} MiB")
    assert_all(torch.equal(m2.weight._local_tensor, m.weight._local_tensor), "loaded shard")
    del m, m2


@pytest.mark.mpi(min_size=1)
def test_cli_export_and_checksums_on_an_fsdp2_checkpoint(pg, comm, world, shared_tmp_path):
    """``python -m ckpt`` inspect / verify, export (safetensors, DeepSpeed universal) read an FSDP2 checkpoint; a
    flipped byte is a ChecksumError on every rank when loading into FSDP2."""
    mesh = init_device_mesh("cpu", (comm.size,))
    m, opt = trained(mesh, comm)
    path = str(shared_tmp_path / "ck")
    ckpt.save(path, model=m, optimizer=opt, step=1, comm=comm)
    ref = {k: v.full_tensor() for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    state = {(names[id(p)], k): (v.full_tensor() if isinstance(v, DTensor) else v)
             for p, s in opt.state.items() for k, v in s.items()}
    ckpt.to_deepspeed_universal(path, str(shared_tmp_path / "uni" / "tag"), comm=comm)

    def check():
        import contextlib
        import io

        from ckpt import cli

        for argv, want in ((["inspect", "--tensors", path], f"from {comm.size} DTensor shard(s)"),
                           (["verify", path], "ok")):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = cli.main(argv)
            assert rc == 0 and want in buf.getvalue(), buf.getvalue()
        out = ckpt.export_safetensors(path, str(shared_tmp_path / "model.safetensors"))
        from safetensors.torch import load_file
        got = load_file(out)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        for (n, k), v in state.items():
            pt = torch.load(os.path.join(shared_tmp_path, "uni", "tag", "zero", n,
                                         f"{'step' if k == 'step' else k}.pt"), weights_only=True)
            pt = pt if k == "step" else pt["param"]
            assert torch.equal(pt, v), (n, k)

    if comm.rank == 0:
        check()
        with open(os.path.join(path, "data.bin"), "r+b") as f:  # a byte inside '0.weight' (block 0)
            e = next(t for t in ckpt.read_manifest(path).tensors if t.name == "0.weight" and t.kind == "param")
            f.seek(e.offset + e.nbytes - 3)
            b = f.read(1)
            f.seek(e.offset + e.nbytes - 3)
            f.write(bytes([b[0] ^ 0x40]))
    world.Barrier()
    m2 = fsdp_model(mesh, seed=3)
    raises_everywhere(lambda: ckpt.load(path, model=m2, comm=comm), ckpt.ChecksumError, r"'0.weight' param")


@pytest.mark.mpi(min_size=1)
def test_deepspeed_checkpoint_imports_into_fsdp2(pg, comm, world, shared_tmp_path):
    from test_ckpt_ds_format import GROUPS, HYPER, SHAPES, STEP, Net, make, truth

    src, ours = str(shared_tmp_path / "ds"), str(shared_tmp_path / "ours")
    if comm.rank == 0:
        make(src, 1, 3)
    world.Barrier()
    ckpt.from_deepspeed(src, ours, comm=comm)
    t = truth()
    mesh = init_device_mesh("cpu", (comm.size,))
    net = Net(torch.float32)
    for sub in (net.enc, net.dec):
        fully_shard(sub, mesh=mesh)
    fully_shard(net, mesh=mesh)
    p = dict(net.named_parameters())
    opt = torch.optim.Adam([{"params": [p[n] for n in g], **h} for g, h in zip(GROUPS, HYPER)])
    ckpt.load(ours, model=net, optimizer=opt, comm=comm)
    got = {n: p[n].full_tensor() for n in SHAPES}
    st = {(n, k): opt.state[p[n]][k].full_tensor() for n in SHAPES for k in ("exp_avg", "exp_avg_sq")}
    steps = {float(opt.state[p[n]]["step"]) for n in SHAPES}

    def check():
        for n in SHAPES:
            assert torch.equal(got[n], t[n]["fp32"]), n
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[(n, k)], t[n][k]), (n, k)
        assert steps == {float(STEP)}
    check_all(check)
