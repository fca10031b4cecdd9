"""ZeroOneAdam and OnebitLamb through ckpt.save / ckpt.load: bit-identical resume at the same size
(in warm-up, in a local-step interval, after the freeze), and at another size (4 <-> 2, 2 <-> 1)
the counters kept, the error feedback by the documented rule (``compressed.reshard``, mean kept)
and, inside a 0/1 Adam local interval, every rank starting from the saved ranks' mean."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ckpt
import compressed
from mpitest import check_all
from test_cmp_backend import group
from test_cmp_ckpt import _model, _steps
from test_cmp_state import rule_numpy


def zoadam(params, comm):
    # variance steps 1, 2, 4; then syncs at 5, 6, 8, 12 (local steps 7, 9-11)
    return compressed.ZeroOneAdam(params, lr=0.01, weight_decay=0.01, var_freeze_step=4, var_update_scaler=2,
                                  local_step_scaler=1, local_step_clipper=4, comm=comm)


def lamb(params, comm):
    return compressed.OnebitLamb(params, lr=0.01, weight_decay=0.01, freeze_step=3, comm=comm)


FACTORIES = {"zoadam": zoadam, "lamb": lamb}
COUNTERS = {"zoadam": "zero_one", "lamb": "onebit_lamb"}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind,save_at,end", [("zoadam", 3, 13), ("zoadam", 7, 13), ("zoadam", 10, 13),
                                              ("lamb", 2, 7), ("lamb", 5, 7)])
def test_resume_at_the_same_size_is_bit_identical(world, comm, shared_tmp_path, kind, save_at, end):
    path = shared_tmp_path / f"{kind}-{save_at}"
    make = FACTORIES[kind]

    def run():
        model = _model()
        opt = make(model.parameters(), comm)
        _steps(model, opt, 0, save_at, comm.rank)
        ckpt.save(path, model=model, optimizer=opt, step=save_at, comm=comm)
        _steps(model, opt, save_at, end, comm.rank)
        model2 = _model()
        opt2 = make(model2.parameters(), comm)
        ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
        assert opt2.global_step == save_at
        _steps(model2, opt2, save_at, end, comm.rank)
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q), float((p - q).abs().max())
        for p, q in zip(model.parameters(), model2.parameters()):
            a, b = opt.state[p], opt2.state[q]
            assert sorted(a) == sorted(b)
            for k in a:
                assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
        assert opt.state_dict()[COUNTERS[kind]] == opt2.state_dict()[COUNTERS[kind]]

    check_all(run, world)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind,save_at,end", [("zoadam", 10, 12), ("lamb", 5, 7)])
def test_resume_at_another_size_keeps_the_mean(world, shared_tmp_path, kind, save_at, end):
    big = 4 if world.size >= 4 else 2
    pairs = [(big, big // 2), (big // 2, big)]
    make = FACTORIES[kind]

    def run():
        for i, (q_save, q_load) in enumerate(pairs):
            path = shared_tmp_path / f"{kind}-resize-{i}"
            saved = None
            sub, comm = group(world, q_save)
            if comm is not None:
                model = _model()
                opt = make(model.parameters(), comm)
                _steps(model, opt, 0, save_at, comm.rank)
                saved = sub.allgather(copy.deepcopy(opt.per_rank_state_dict()))
                ckpt.save(path, model=model, optimizer=opt, step=save_at, comm=comm)
            saved = world.bcast(saved, root=0)
            sub, comm = group(world, q_load)
            if comm is None:
                continue
            model2 = _model()
            opt2 = make(model2.parameters(), comm)
            ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
            assert opt2.per_rank_state_dict()[COUNTERS[kind]] == {
                **saved[0][COUNTERS[kind]], **({"lrs": [0.0]} if kind == "zoadam" else {})}
            errors = [s["allreduce"] for s in saved]
            for key in errors[0]["errors"]:
                we, se = rule_numpy(errors, key, comm.rank, q_load)
                got_we, got_se = opt2.onebit.errors(key)
                np.testing.assert_allclose(got_we.numpy(), we, rtol=1e-6, atol=1e-7)
                np.testing.assert_array_equal(got_se.numpy(), se.astype(np.float32))
            if kind == "zoadam":   # inside a local interval: the mean over the saved ranks
                assert all(s["local"] is not None for s in saved)
                for j, p in enumerate(model2.parameters()):
                    mean = np.mean([s["local"]["params"][j].double().numpy() for s in saved], axis=0)
                    np.testing.assert_allclose(p.detach().double().numpy(), mean, rtol=1e-6, atol=1e-7)
            _steps(model2, opt2, save_at, end, comm.rank)
            flat = torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).numpy()
            everyone = sub.allgather(flat)
            assert all(np.array_equal(flat, other) for other in everyone), "ranks disagree after resume"

    check_all(run, world)
