"""DeepSpeed interoperability against real DeepSpeed 0.19 checkpoints made on the CPU.

Each configuration is trained and saved once per session by ``mpiexec -n N python -m mpi4py
tests/ds_make_checkpoint.py save``, which also records DeepSpeed's own view of every
parameter (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``) and runs
DeepSpeed's ``ds_to_universal``. These are the references: our import must equal the first,
our export (through our own format) the second, bit for bit; and DeepSpeed must load our
export at another world size, hold exactly the saved state, and train on.
Skipped when deepspeed is not installed, and inside multi-rank pytest runs (it launches its
own MPI jobs).
"""
from __future__ import annotations

import glob
import importlib.util
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
from mpicomm import clean_env
import torch
from mpi4py import MPI

from ckpt.deepspeed import from_deepspeed, read_deepspeed, to_deepspeed_universal
from zero import ZeroOptimizer
from mpitest import mpiexec_cmd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own mpiexec jobs; run single-process"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ds_make_checkpoint.py")
TAG = "t"
KEYS = ("fp32", "exp_avg", "exp_avg_sq")

# (dtype, ZeRO stage, ranks that save)
CONFIGS = [("fp32", 1, 2), ("fp32", 1, 4), ("bf16", 1, 2), ("fp32", 3, 2)]
IDS = [f"{d}-zero{s}-{n}ranks" for d, s, n in CONFIGS]
# every ZeRO stage in both dtypes DeepSpeed saves on the CPU: each imports with no flag
IMPORTS = CONFIGS + [("fp32", 2, 2), ("bf16", 2, 2), ("bf16", 3, 2)]
IMPORT_IDS = [f"{d}-zero{s}-{n}ranks" for d, s, n in IMPORTS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, *args: str, timeout: int = 300) -> None:
    """Run ds_make_checkpoint.py on ``n`` ranks; fail with its output if it fails."""
    env = clean_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    env["DS_ACCELERATOR"] = "cpu"  # gloo on the CPU even where a GPU is present
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", SCRIPT, *args]
    for attempt in range(3):
        # the free port can be taken by another socket before DeepSpeed's store binds it: the
        # job then fails at start-up (EADDRINUSE, its peers terminated); start it again on another
        env["DS_TEST_PORT"] = str(_free_port())
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{(exc.stderr or b'')[-3000:]!r}")
        if out.returncode == 0 or "EADDRINUSE" not in out.stdout + out.stderr:
            break
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


@pytest.fixture(scope="session")
def ds_checkpoint(tmp_path_factory):
    """cfg -> root folder holding tag ``t``, ``t.truth.pt`` and ``t_universal`` (made once)."""
    made: dict[tuple, str] = {}

    def get(cfg: tuple) -> str:
        if cfg not in made:
            dtype, stage, n = cfg
            root = str(tmp_path_factory.mktemp(f"ds-{dtype}-z{stage}-{n}"))
            launch(n, "save", "--root", root, "--tag", TAG, "--stage", str(stage), "--dtype", dtype,
                   "--steps", "3", "--universal")
            made[cfg] = root
        return made[cfg]

    return get


@pytest.fixture(scope="session")
def our_export(ds_checkpoint, tmp_path_factory):
    """cfg -> (our checkpoint, our universal export tag folder), made once."""
    made: dict[tuple, tuple[str, str]] = {}

    def get(cfg: tuple) -> tuple[str, str]:
        if cfg not in made:
            import mpicomm

            root = ds_checkpoint(cfg)
            base = tmp_path_factory.mktemp("ours")
            ours, out = str(base / "ckpt"), str(base / "export" / "tag")
            from_deepspeed(os.path.join(root, TAG), ours, comm=mpicomm.init())
            to_deepspeed_universal(ours, out)
            made[cfg] = (ours, out)
        return made[cfg]

    return get


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("cfg", IMPORTS, ids=IMPORT_IDS)
def test_import_equals_deepspeeds_own_view(ds_checkpoint, tmp_path, cfg):
    root = ds_checkpoint(cfg)
    truth = torch.load(os.path.join(root, f"{TAG}.truth.pt"), weights_only=False)
    st = read_deepspeed(os.path.join(root, TAG))  # no flag: DeepSpeed's own classes are allowlisted
    assert st.world_size == cfg[2] and st.stage == cfg[1] and str(st.dtype) == truth["dtype"]
    assert st.step == truth["step"] == 3
    assert set(st.names) == set(truth["params"]) and st.optimizer_class == "torch.optim.AdamW"
    for name, ref in truth["params"].items():
        for k in KEYS:
            assert _same(st.tensors[name][k], ref[k]), (name, k)
    for name, buf in truth["buffers"].items():
        assert _same(st.model_state[name], buf)
    # and through our format, with no flag either
    import mpicomm

    import ckpt
    from ds_make_checkpoint import TinyNet

    from_deepspeed(os.path.join(root, TAG), tmp_path / "ours", comm=mpicomm.init())
    net = TinyNet().to(getattr(torch, truth["dtype"].split(".")[-1]))
    ckpt.load(tmp_path / "ours", model=net, comm=mpicomm.init())
    for name, p in net.named_parameters():
        assert _same(p.detach(), truth["params"][name]["fp32"].to(p.dtype)), name


def test_damaged_entry_of_a_real_checkpoint_is_refused(ds_checkpoint, tmp_path):
    """64 zeroed bytes inside a tensor entry: refused, naming the file and the entry."""
    import mpicomm
    from test_ckpt_ds_safety import zero_inside_largest_tensor

    from ckpt.deepspeed.pickles import ZipEntryError

    src = tmp_path / "t"
    shutil.copytree(os.path.join(ds_checkpoint(("fp32", 1, 2)), TAG), src)
    fname = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    entry = zero_inside_largest_tensor(str(src / fname))
    with pytest.raises(ZipEntryError) as info:
        from_deepspeed(src, tmp_path / "ours", comm=mpicomm.init())
    assert fname in str(info.value) and entry in str(info.value) and "CRC" in str(info.value)
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_export_equals_ds_to_universal(ds_checkpoint, our_export, cfg):
    ref = os.path.join(ds_checkpoint(cfg), f"{TAG}_universal")
    _, out = our_export(cfg)
    files = sorted(os.path.relpath(p, ref) for p in glob.glob(os.path.join(ref, "zero", "*", "*.pt")))
    assert len(files) >= 3 * 6, files
    for rel in files:
        theirs = torch.load(os.path.join(ref, rel), weights_only=False)
        mine = torch.load(os.path.join(out, rel), weights_only=True)
        if isinstance(theirs, dict):      # ZeRO-1/2: {"param": full-shape tensor, "cat_dim": 0}
            assert _same(mine["param"], theirs["param"]), rel
            assert mine.get("cat_dim", 0) == theirs.get("cat_dim", 0)
        elif isinstance(theirs, torch.Tensor) and theirs.dim() == 1 and not rel.endswith("step.pt"):
            # ZeRO-3: DeepSpeed stores the flat tensor; ours keeps the shape
            assert _same(mine["param"].reshape(-1), theirs), rel
        else:                             # step.pt
            assert _same(mine, theirs), rel


EXPORT_LOADS = [(("fp32", 1, 4), 2), (("bf16", 1, 2), 3), (("fp32", 3, 2), 3)]


@pytest.mark.parametrize("cfg,ranks", EXPORT_LOADS,
                         ids=[f"{d}-zero{s}-{n}to{m}" for (d, s, n), m in EXPORT_LOADS])
def test_deepspeed_loads_our_export_at_another_size_and_trains(ds_checkpoint, our_export, tmp_path, cfg, ranks):
    dtype, stage, _ = cfg
    truth = torch.load(os.path.join(ds_checkpoint(cfg), f"{TAG}.truth.pt"), weights_only=False)
    ours, _ = our_export(cfg)
    root = tmp_path / "root"
    to_deepspeed_universal(ours, str(root / "mine"))
    launch(ranks, "load", "--root", str(root), "--stage", str(stage), "--dtype", dtype, "--steps", "3",
           "--seed", "7")
    got = torch.load(root / f"loaded.{ranks}.pt", weights_only=False)
    assert got["world_size"] == ranks and got["step"] == truth["step"]
    for name, ref in truth["params"].items():
        for k in KEYS:
            assert _same(got["params"][name][k], ref[k]), (name, k)
        w = got["weights"][name]
        assert _same(w, ref["fp32"].to(w.dtype)), name
    assert len(got["losses"]) == 3 and all(math.isfinite(x) for x in got["losses"])


def test_deepspeed_loads_export_of_our_own_zero_checkpoint(tmp_path):
    """A checkpoint trained and saved by ZeroOptimizer (never DeepSpeed's) resumes in DeepSpeed."""
    import mpicomm

    import ckpt
    from ds_make_checkpoint import TinyNet, batches

    comm = mpicomm.init()
    torch.manual_seed(0)
    net = TinyNet()
    zero = ZeroOptimizer(torch.optim.AdamW, net.parameters(), stage=1, comm=comm, lr=0.01,
                              betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01)
    for x, y in batches(0, 3, 5, torch.float32):
        zero.zero_grad()
        net(x, y).backward()
        zero.step()
    ckpt.save(tmp_path / "ours", model=net, optimizer=zero, step=3, comm=comm)
    root = tmp_path / "root"
    to_deepspeed_universal(tmp_path / "ours", root / "mine")
    launch(2, "load", "--root", str(root), "--stage", "1", "--dtype", "fp32", "--steps", "2")
    got = torch.load(root / "loaded.2.pt", weights_only=False)
    names = [n for n, _ in net.named_parameters()]
    g = zero.groups[0]
    state = zero.shard_state(0)
    assert got["step"] == 3
    for s in g.layout.segments(0):
        name = names[s.param]
        for k, flat in (("fp32", g.master), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            want = flat[s.local:s.local + s.length]
            assert torch.equal(got["params"][name][k].reshape(-1)[s.start:s.start + s.length], want), (name, k)
    for name, p in net.named_parameters():
        assert _same(got["weights"][name], p.detach()), name
    assert len(got["losses"]) == 2 and all(math.isfinite(x) for x in got["losses"])
