"""``python -m ckpt convert|export``: DeepSpeed in and out, consent to pickle, progress bar, exit codes.

DeepSpeed checkpoints here are the fake ones of test_ckpt_ds_format (laid out as DeepSpeed 0.19
lays them out); the expected values are the tensors they were cut from."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpicomm import clean_env
import torch
from mpi4py import MPI

import ckpt
from ckpt import cli as ckpt_cli
from test_ckpt_ds_format import SHAPES, Net, make
from mpitest import mpiexec_cmd
from test_ckpt_reliability import ROOT

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="single-process test (runs its own jobs)")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = ckpt_cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def loaded_net(path) -> Net:
    net = Net(torch.float32)
    ckpt.load(path, model=net, comm=MPI.COMM_SELF)
    return net


def universal(out_dir, name: str, key: str = "fp32") -> torch.Tensor:
    return torch.load(os.path.join(out_dir, "zero", name, f"{key}.pt"), weights_only=True)["param"]


def test_help_documents_every_exit_code():
    out = subprocess.run([sys.executable, "-m", "ckpt", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "exit codes:" in out.stdout and "convert" in out.stdout and "export" in out.stdout
    codes = [v for k, v in vars(ckpt_cli).items() if k.startswith("EXIT_") and isinstance(v, int)]
    assert sorted(codes) == list(range(7))
    for c in codes:
        assert f"\n  {c}  " in out.stdout, f"exit code {c} undocumented"
    help_convert = ckpt_cli.parser()._subparsers._group_actions[0].choices["convert"].format_help()
    assert "--allow-pickle" in help_convert and "unnecessary" in help_convert


def test_convert_needs_no_consent_then_round_trips(tmp_path, capsys):
    t = make(str(tmp_path / "ds"), 1, 3)
    dst = tmp_path / "ours"
    code, out, err = cli(capsys, "convert", "--from", "deepspeed", str(tmp_path / "ds"), str(dst))
    assert code == 0 and out.startswith("ok: "), err
    assert err == "", "no progress bar when stderr is not a terminal"
    net = loaded_net(dst)
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), t[n]["fp32"]), n
    m = ckpt.read_manifest(dst)
    assert (m.step, m.world_size, m.stage) == (5, 1, 1) and m.state_keys() == ["exp_avg", "exp_avg_sq"]

    code, _, err = cli(capsys, "convert", "--from", "deepspeed", str(tmp_path / "ds"), str(dst), "--allow-pickle")
    assert code == ckpt_cli.EXIT_EXISTS and "--overwrite" in err
    code, _, err = cli(capsys, "convert", "--from", "deepspeed", str(tmp_path / "nothing"), str(tmp_path / "x"),
                       "--allow-pickle")
    assert code == ckpt_cli.EXIT_USAGE and "no DeepSpeed checkpoint folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "convert", "--from", "deepspeed", str(tmp_path / "empty"), str(tmp_path / "x"),
                       "--allow-pickle")
    assert code == ckpt_cli.EXIT_FAILED and "no model states file" in err

    # and back out as DeepSpeed's universal layout, with a progress bar on request
    uni = tmp_path / "uni" / "tag"
    code, out, err = cli(capsys, "export", "--to", "deepspeed-universal", str(dst), str(uni), "--progress")
    assert code == 0, err
    assert "export: writing [" in err and err.rstrip().endswith(f"100% {len(SHAPES)}/{len(SHAPES)}"), err
    for n in SHAPES:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(universal(uni, n, k), t[n][k]), (n, k)
    assert (tmp_path / "uni" / "latest_universal").read_text() == "tag"
    code, _, err = cli(capsys, "export", "--to", "deepspeed-universal", str(dst), str(uni))
    assert code == ckpt_cli.EXIT_EXISTS

    ckpt.save(tmp_path / "bare", model=Net(torch.float32), comm=MPI.COMM_SELF)
    code, _, err = cli(capsys, "export", "--to", "deepspeed-universal", str(tmp_path / "bare"), str(tmp_path / "u2"))
    assert code == ckpt_cli.EXIT_FAILED and "no optimizer state" in err
    code, _, err = cli(capsys, "export", "--to", "deepspeed-universal", str(tmp_path / "nope"), str(tmp_path / "u3"))
    assert code == ckpt_cli.EXIT_USAGE and "does not exist" in err
    with pytest.raises(SystemExit) as info:
        ckpt_cli.main(["export", "--to", "megatron", str(dst), str(tmp_path / "u4")])
    assert info.value.code == ckpt_cli.EXIT_USAGE


def test_progress_only_when_asked_or_a_terminal(monkeypatch, capsys, tmp_path):
    ckpt.save(tmp_path / "c", model=Net(torch.float32), comm=MPI.COMM_SELF)

    def bar(*flags: str) -> bool:
        code, out, err = cli(capsys, "verify", str(tmp_path / "c"), *flags)
        assert code == 0 and out.startswith("ok: "), err
        return "verifying [" in err

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert bar() and not bar("--no-progress")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not bar() and bar("--progress")


def test_convert_and_export_in_parallel_under_mpiexec(tmp_path):
    t = make(str(tmp_path / "ds"), 3, 2)
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")

    def run(*args):
        cmd = [*mpiexec_cmd(2), sys.executable, "-m", "ckpt", *args]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
        return out

    out = run("convert", "--from", "deepspeed", str(tmp_path / "ds"), str(tmp_path / "ours"), "--allow-pickle",
              "--progress")
    assert out.stdout.count("ok: ") == 1, "one report, from rank 0"
    assert "convert: writing [" in out.stderr
    done = f"convert: writing [{'#' * 30}] 100% 1/1"
    assert out.stderr.count(done) == 1, f"a bar from rank 0 only, --progress or not: {out.stderr[-2000:]}"
    m = ckpt.read_manifest(tmp_path / "ours")
    assert (m.world_size, m.stage) == (2, 2)  # ZeRO-3 imports as stage 2
    net = loaded_net(tmp_path / "ours")  # saved by 2 ranks, loaded by 1
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), t[n]["fp32"]), n
    run("export", "--to", "deepspeed-universal", str(tmp_path / "ours"), str(tmp_path / "uni" / "tag"))
    for n in SHAPES:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(universal(tmp_path / "uni" / "tag", n, k), t[n][k]), (n, k)
