"""Every corrupted byte is a named error: a seeded mutation fuzz of manifest.json, data.bin and
DeepSpeed's zip files. Each mutated checkpoint either raises a CheckpointError that names the
mutated file, or loads data bit-identical to what was saved (the reference is the objects that
were saved, never a load of the pristine checkpoint). One process (a comm of size 1), so that
the 1,000+ cases stay fast.

Categories: byte flips, truncations, insertions and JSON edits of the manifest (caught by its own
checksum or its field checks); the same JSON edits with the checksum recomputed, as a buggy
writer would leave them, and edits of a manifest of format version 3 (no checksum), where any
CheckpointError or a load is acceptable but no other exception; byte flips, truncations,
appends and safetensors header-length and header edits of data.bin; byte flips and truncations
of the zip files of a DeepSpeed checkpoint, read by ckpt's DeepSpeed import."""
from __future__ import annotations

import copy
import json
import random
import shutil
import struct

import pytest
import torch
from mpi4py import MPI

import ckpt
from ckpt.deepspeed import read_deepspeed
from ckpt.manifest import MANIFEST_CRC_FIELD, manifest_crc
from conftest import single_process

pytestmark = pytest.mark.once    # the same on any MPI: CI runs it on MPICH only

SEED = 20261130
BLOCK = 256


def _template() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    m.register_buffer("count", torch.arange(3, dtype=torch.int64))
    return m


TEMPLATE = _template()


def make_model() -> torch.nn.Module:
    return copy.deepcopy(TEMPLATE)


def make_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.001, betas=(0.8, 0.99))


def blank_table() -> dict:
    return {"w": torch.zeros(2, 3, dtype=torch.float16), "k": 0, "t": (0, "")}


def _bits(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return (t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))


def snapshot(model, opt, table, res) -> dict:
    """Everything a load sets, exactly (tensors as dtype, shape and raw bytes)."""
    sd = opt.state_dict()
    return {"model": {k: _bits(v) for k, v in model.state_dict().items()},
            "opt": {i: {k: _bits(v) if torch.is_tensor(v) else v for k, v in st.items()}
                    for i, st in sd["state"].items()},
            "groups": sd["param_groups"], "table": {k: _bits(v) if torch.is_tensor(v) else v for k, v in table.items()},
            "step": res.step if res is not None else 7, "extra": res.extra if res is not None else {"run": "fuzz"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-rank checkpoint (model, Adam, a state item, step, extra) and what was saved."""
    root = tmp_path_factory.mktemp("fuzz")
    model = make_model()
    opt = make_opt(model)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    table = {"w": torch.arange(6, dtype=torch.float16).reshape(2, 3), "k": 4, "t": (1, "a")}
    ckpt.save(root / "ck", model=model, optimizer=opt, step=7, extra={"run": "fuzz"}, state={"table": table},
              comm=MPI.COMM_SELF, block_size=BLOCK, chunk_bytes=4 * BLOCK)
    d = root / "ck"
    return {"root": root, "manifest": (d / "manifest.json").read_bytes(), "data": (d / "data.bin").read_bytes(),
            "want": snapshot(model, opt, table, None)}


def attempt(path) -> tuple[BaseException | None, dict | None]:
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = make_opt(model)
    table = blank_table()
    try:
        res = ckpt.load(path, model=model, optimizer=opt, comm=MPI.COMM_SELF, state={"table": table})
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return exc, None
    return None, snapshot(model, opt, res.state["table"], res)


# -- mutations ---------------------------------------------------------------------------------

def flip(b: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> tuple[bytes, str]:
    hi = len(b) if hi is None else hi
    out = bytearray(b)
    where = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        i = rng.randrange(lo, hi)
        out[i] ^= rng.choice((1, 2, 4, 8, 16, 32, 64, 128, 0xFF, rng.randrange(1, 256)))
        where.append(i)
    return bytes(out), f"flip at {where}"


def truncate(b: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = rng.randrange(0, len(b))
    return b[:n], f"truncate to {n}"


def insert_or_delete(b: bytes, rng: random.Random) -> tuple[bytes, str]:
    i = rng.randrange(0, len(b))
    if rng.random() < 0.5:
        c = rng.choice(b' 0}]",:1-.e\n')
        return b[:i] + bytes([c]) + b[i:], f"insert {chr(c)!r} at {i}"
    return b[:i] + b[i + 1:], f"delete byte {i}"


REPLACEMENTS = [None, True, False, -1, 0, 1, 3, 2 ** 40, 1.5, float("nan"), "x", "", [], {}, [1], {"a": 1},
                "float64", "data.bin", "item", "state", [0, 0], {"@tensor": 5}, {"@tuple": 1}]


def _paths(x, p=()):
    yield p
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, p + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, p + (i,))


def json_edit(d: dict, rng: random.Random) -> str:
    """One random edit of the parsed manifest ``d`` in place: delete, replace or nudge a value."""
    path = rng.choice(list(_paths(d))[1:])
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    op = rng.choice(("delete", "replace", "nudge", "nudge"))
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = rng.choice(REPLACEMENTS)
    elif isinstance(old, bool):
        parent[key] = not old
    elif isinstance(old, int):
        parent[key] = rng.choice((old + 1, old - 1, old * 2, old + rng.randrange(1, 1 << 12), -old))
    elif isinstance(old, float):
        parent[key] = rng.choice((old * 9, old + 1e-9, -old))
    elif isinstance(old, str):
        parent[key] = rng.choice((old + "x", old[:-1], old.upper()))
    elif isinstance(old, list):
        if old and rng.random() < 0.5:
            old.pop(rng.randrange(len(old)))
        else:
            old.append(old[0] if old else 1)
    elif isinstance(old, dict):
        old["zz"] = 1
    else:
        parent[key] = 0
    return f"json {op} {'/'.join(map(str, path))}"


# -- the judge ---------------------------------------------------------------------------------

def judge(case: str, exc, got, want, file: str, named: bool, escapes: list) -> str:
    """'error' or 'same'; appends to ``escapes`` what breaks the guarantee."""
    if exc is not None:
        if not isinstance(exc, ckpt.CheckpointError):
            escapes.append(f"{case}: {type(exc).__name__}: {exc}")
        elif named and file not in str(exc):
            escapes.append(f"{case}: {type(exc).__name__} does not name {file}: {exc}")
        return "error"
    if want is not None and got != want:
        diff = sorted(k for k in want if got.get(k) != want.get(k))
        escapes.append(f"{case}: loaded without error but different data in {diff}")
    return "same"


def write(d, manifest: bytes, data: bytes) -> None:
    (d / "manifest.json").write_bytes(manifest)
    (d / "data.bin").write_bytes(data)


@single_process
def test_mutated_checkpoints_raise_named_errors_or_load_identically(saved, tmp_path):
    rng = random.Random(SEED)
    d = tmp_path / "ck"
    d.mkdir()
    man, data, want = saved["manifest"], saved["data"], saved["want"]
    write(d, man, data)
    exc, got = attempt(d)
    assert exc is None and got == want, f"the pristine checkpoint must load exactly: {exc}"

    parsed = json.loads(man)
    hlen = struct.unpack("<Q", data[:8])[0]
    escapes: list[str] = []
    counts: dict[str, dict[str, int]] = {}

    def run(cat: str, manifest: bytes, payload: bytes, what: str, file: str, strict: bool = True) -> None:
        write(d, manifest, payload)
        exc, got = attempt(d)
        outcome = judge(f"{cat} {what}", exc, got, want if strict else None, file, strict, escapes)
        counts.setdefault(cat, {}).setdefault(outcome, 0)
        counts[cat][outcome] += 1

    for _ in range(180):
        m, what = flip(man, rng)
        run("manifest-flip", m, data, what, "manifest.json")
    for _ in range(60):
        m, what = truncate(man, rng)
        run("manifest-truncate", m, data, what, "manifest.json")
    for _ in range(60):
        m, what = insert_or_delete(man, rng)
        run("manifest-insdel", m, data, what, "manifest.json")
    for _ in range(120):
        e = json.loads(man)
        what = json_edit(e, rng)
        run("manifest-json", json.dumps(e, indent=1).encode(), data, what, "manifest.json")
    # a buggy writer: edits under a recomputed checksum; then a version-3 manifest (no checksum)
    for _ in range(150):
        e = json.loads(man)
        e.pop(MANIFEST_CRC_FIELD)
        what = json_edit(e, rng)
        e[MANIFEST_CRC_FIELD] = manifest_crc(e)
        run("manifest-json-recrc", json.dumps(e).encode(), data, what, "manifest.json", strict=False)
    v3 = {k: v for k, v in parsed.items() if k != MANIFEST_CRC_FIELD}
    v3["version"] = 3
    for _ in range(100):
        e = json.loads(json.dumps(v3))
        what = json_edit(e, rng)
        run("manifest-v3-json", json.dumps(e, indent=1).encode(), data, what, "manifest.json", strict=False)

    for _ in range(200):
        b, what = flip(data, rng)
        run("data-flip", man, b, what, "data.bin")
    for _ in range(40):
        b, what = truncate(data, rng)
        run("data-truncate", man, b, what, "data.bin")
    for _ in range(20):
        n = rng.randrange(1, 3 * BLOCK)
        run("data-append", man, data + bytes(rng.randrange(256) for _ in range(n)), f"append {n}", "data.bin")
    for _ in range(40):
        new = rng.choice((hlen + 1, hlen - 8, hlen * 2, 0, 2 ** 63, len(data), rng.randrange(1 << 32)))
        run("data-header-length", man, struct.pack("<Q", new) + data[8:], f"header length {new}", "data.bin")
    for _ in range(40):
        b, what = flip(data, rng, 8, 8 + hlen)
        run("data-header", man, b, what, "data.bin")

    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{total} cases: " + "; ".join(f"{k} {v}" for k, v in counts.items()))
    assert total >= 1000
    assert counts["manifest-flip"].get("error", 0) > 150 and counts["data-flip"].get("error", 0) > 100
    assert not escapes, f"{len(escapes)} escapes of {total}:\n" + "\n".join(escapes[:40])


@single_process
def test_a_changed_learning_rate_is_refused(saved, tmp_path):
    """The example from the issue: valid JSON, one hyperparameter changed."""
    d = tmp_path / "ck"
    d.mkdir()
    text = saved["manifest"].decode()
    assert '"lr": 0.001' in text
    write(d, text.replace('"lr": 0.001', '"lr": 0.009').encode(), saved["data"])
    exc, _ = attempt(d)
    assert isinstance(exc, ckpt.DamagedCheckpointError) and "manifest.json" in str(exc), exc
    assert "fails its own checksum" in str(exc)
    # re-indenting is no change: the checksum covers the data, not the spelling
    write(d, json.dumps(json.loads(text), indent=4, sort_keys=True).encode(), saved["data"])
    exc, got = attempt(d)
    assert exc is None and got == saved["want"], exc
    # a version-4 manifest without its checksum field is refused; the same data as version 3 loads
    e = json.loads(text)
    del e[MANIFEST_CRC_FIELD]
    write(d, json.dumps(e).encode(), saved["data"])
    exc, _ = attempt(d)
    assert isinstance(exc, ckpt.DamagedCheckpointError) and "lacks its checksum" in str(exc), exc
    e["version"] = 3
    write(d, json.dumps(e).encode(), saved["data"])
    exc, got = attempt(d)
    assert exc is None and got == saved["want"], exc


@single_process
def test_mutated_deepspeed_files_raise_named_errors_or_read_identically(tmp_path):
    from test_ckpt_ds_format import make

    rng = random.Random(SEED + 1)
    src = tmp_path / "src"
    truth = make(str(src), 1, 2)
    files = sorted(p.name for p in src.iterdir())
    pristine = {f: (src / f).read_bytes() for f in files}
    def everything(st) -> dict:
        return {"tensors": {n: {k: _bits(v) for k, v in st.tensors[n].items()} for n in st.names},
                "model": {k: _bits(v) for k, v in st.model_state.items()}, "step": (st.step, st.step_dtype),
                "groups": st.param_groups, "shapes": st.shapes, "stage": st.stage}

    want = everything(read_deepspeed(src))
    assert all(_bits(truth[n][k]) == want["tensors"][n][k] for n in truth for k in truth[n]), "reader vs truth"
    escapes: list[str] = []
    counts: dict[str, int] = {"error": 0, "same": 0}
    d = tmp_path / "ds"
    for i in range(200):
        f = rng.choice(files)
        b = pristine[f]
        if i % 5 == 4:
            b, what = truncate(b, rng)
        else:
            b, what = flip(b, rng)
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(src, d)
        (d / f).write_bytes(b)
        try:
            got, exc = everything(read_deepspeed(d)), None
        except Exception as e:  # noqa: BLE001 - judged below
            exc, got = e, None
        counts[judge(f"{f} {what}", exc, got, want, f, True, escapes)] += 1
    print(f"\nDeepSpeed zip mutations: {counts}")
    assert counts["error"] > 100
    assert not escapes, f"{len(escapes)} escapes:\n" + "\n".join(escapes[:40])


@single_process
def test_the_two_escapes_of_the_issue(saved, tmp_path):
    """Found by the first fuzz of the issue: a checkpoint whose block size does not divide the load's
    chunk size (a ValueError from the I/O planner), and a manifest without optimizer scalars (a
    KeyError). The first is a valid checkpoint and loads; the second is a named error even in a
    version-3 manifest, which has no checksum to catch the edit."""
    model = make_model()
    opt = make_opt(model)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    ckpt.save(tmp_path / "odd", model=model, optimizer=opt, comm=MPI.COMM_SELF, block_size=3 * 96,
              chunk_bytes=3 * 96 * 4)
    other = make_model()
    other_opt = make_opt(other)
    ckpt.load(tmp_path / "odd", model=other, optimizer=other_opt, comm=MPI.COMM_SELF)  # default chunk_bytes
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    d = tmp_path / "ck"
    d.mkdir()
    e = json.loads(saved["manifest"])
    del e[MANIFEST_CRC_FIELD]
    e["version"] = 3
    del e["optimizer"]["scalars"]
    write(d, json.dumps(e).encode(), saved["data"])
    exc, _ = attempt(d)
    assert isinstance(exc, ckpt.ManifestError) and "manifest.json" in str(exc) and "scalars" in str(exc), exc
