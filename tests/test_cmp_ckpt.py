"""1-bit Adam through ckpt.save / ckpt.load: bit-identical resume at the same size, the error
mass carried by the documented rule (``compressed.reshard``) at another size."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ckpt
import compressed
from mpitest import check_all
from test_cmp_backend import group
from test_cmp_state import rule_numpy

FREEZE = 2


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3)).to(dtype)


def _steps(model, opt, first: int, last: int, rank: int) -> None:
    for k in range(first, last):
        gen = torch.Generator().manual_seed(1000 * k + rank)
        dtype = next(model.parameters()).dtype
        x = torch.randn(16, 12, generator=gen).to(dtype)
        y = torch.randn(16, 3, generator=gen).to(dtype)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        opt.step()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("save_at", [1, 4])  # in warm-up, after freeze_step
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_at_the_same_size_is_bit_identical(world, comm, shared_tmp_path, save_at, dtype):
    path = shared_tmp_path / f"onebit-{save_at}"

    def run():
        model = _model(dtype)
        opt = compressed.OnebitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, comm=comm)
        _steps(model, opt, 0, save_at, comm.rank)
        ckpt.save(path, model=model, optimizer=opt, step=save_at, comm=comm)
        _steps(model, opt, save_at, 7, comm.rank)
        model2 = _model(dtype)
        opt2 = compressed.OnebitAdam(model2.parameters(), lr=0.01, freeze_step=1000, comm=comm)
        ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
        assert (opt2.global_step, opt2.freeze_step) == (save_at, FREEZE)
        _steps(model2, opt2, save_at, 7, comm.rank)
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q), float((p.float() - q.float()).abs().max())

    check_all(run, world)


@pytest.mark.mpi(min_size=2)
def test_resume_at_another_size_carries_the_error_mass(world, shared_tmp_path):
    """Saved at q ranks, loaded at q' ranks (4 <-> 2 at 4 ranks, 2 <-> 1 at 2 ranks): step
    counters restored, error buffers as the rule gives, training continues on every rank alike."""
    big = 4 if world.size >= 4 else 2
    pairs = [(big, big // 2), (big // 2, big)]

    def run():
        for i, (q_save, q_load) in enumerate(pairs):
            path = shared_tmp_path / f"resize-{i}"
            saved = None
            sub, comm = group(world, q_save)
            if comm is not None:
                model = _model()
                opt = compressed.OnebitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, comm=comm)
                _steps(model, opt, 0, FREEZE + 2, comm.rank)
                saved = sub.allgather(copy.deepcopy(opt.per_rank_state_dict()["allreduce"]))
                ckpt.save(path, model=model, optimizer=opt, step=FREEZE + 2, comm=comm)
            saved = world.bcast(saved, root=0)
            sub, comm = group(world, q_load)
            if comm is None:
                continue
            model2 = _model()
            opt2 = compressed.OnebitAdam(model2.parameters(), lr=0.01, freeze_step=1000, comm=comm)
            ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
            assert (opt2.global_step, opt2.freeze_step) == (FREEZE + 2, FREEZE)
            for key in saved[0]["errors"]:
                we, se = rule_numpy(saved, key, comm.rank, q_load)
                got_we, got_se = opt2.onebit.errors(key)
                np.testing.assert_allclose(got_we.numpy(), we, rtol=1e-6, atol=1e-7)
                np.testing.assert_array_equal(got_se.numpy(), se.astype(np.float32))
            _steps(model2, opt2, FREEZE + 2, FREEZE + 4, comm.rank)
            flat = torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).numpy()
            everyone = sub.allgather(flat)
            assert all(np.array_equal(flat, other) for other in everyone), "ranks disagree after resume"

    check_all(run, world)
