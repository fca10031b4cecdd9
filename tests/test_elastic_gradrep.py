"""elastic.gradrep and zero.inner.replay_update in one process: the hyperparameter vector, the
rule that picks a gradient or a full commit, and the replay of an update on a replica, checked
bit for bit against the update the ZeroOptimizer itself made."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpicomm
from elastic import gradrep
from elastic_job_lib import LR, local_loss, make_model
from zero import ZeroOptimizer
from zero.inner import replay_update

pytestmark = pytest.mark.usefixtures("one_thread")


def test_hyperparameters_round_trip_through_the_vector():
    groups = [{"lr": torch.tensor(0.0123), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
               "differentiable": False, "fused": None, "initial_lr": 0.02},
              {"lr": 0.5, "momentum": 0.9, "dampening": 0, "nesterov": True, "name": "head"}]
    sent = [{**groups[0], "lr": torch.tensor(0.0031), "betas": (0.8, 0.99)}, {**groups[1], "lr": 0.25, "dampening": 3}]
    vec = gradrep.encode(sent, [True, False])
    assert vec.dtype == torch.float64 and int(vec[0]) == vec.numel()
    got, flags = gradrep.decode(vec, groups)
    assert flags == [True, False]
    assert got[0]["betas"] == (0.8, 0.99) and isinstance(got[0]["betas"], tuple)
    assert got[0]["lr"].dtype == torch.float32 and got[0]["lr"].item() == torch.tensor(0.0031).item()
    assert got[0]["foreach"] is None and got[0]["amsgrad"] is False and got[0]["initial_lr"] == 0.02
    assert got[1] == {**groups[1], "lr": 0.25, "dampening": 3} and type(got[1]["dampening"]) is int
    assert type(got[1]["nesterov"]) is bool and got[1]["name"] == "head"


def test_hyperparameters_of_another_structure_are_refused():
    vec = gradrep.encode([{"lr": 0.1, "betas": (0.9, 0.99)}], [True])
    with pytest.raises(ValueError, match=r"ward's hyperparameters do not match this rank's \(4 values against 3\)"):
        gradrep.decode(vec, [{"lr": 0.1, "momentum": 0.0}])
    with pytest.raises(TypeError, match="scalar tensor hyperparameters"):
        gradrep.encode([{"lr": torch.ones(2)}], [True])


@pytest.mark.parametrize("previous,same_comm,updates,received,want", [
    (True, True, 1, True, True),
    (False, True, 1, True, False),       # the first commit
    (True, False, 1, True, False),       # after a recovery or a resume (another communicator)
    (True, True, 0, True, False),        # a skipped step, or two commits in a row
    (True, True, 0, False, False),
    (True, True, 2, True, False),        # committing every 2 steps
    (True, True, 1, False, False),       # the gradient did not arrive
])
def test_the_rule_for_a_gradient_commit(previous, same_comm, updates, received, want):
    assert gradrep.gradient_commit(previous, same_comm, updates, received) is want


def test_ward_state_and_join_are_inverse():
    pieces = [torch.arange(4.0), torch.ones(4), torch.zeros(4), torch.arange(3.0), torch.full((3,), 2.0)]
    keys = [["exp_avg", "exp_avg_sq"], ["momentum_buffer"]]
    other = [{"step": torch.tensor(3.0)}, {}]
    masters, states = gradrep.ward_state(pieces, keys, other)
    assert masters[0] is pieces[0] and states[0]["exp_avg_sq"] is pieces[2]
    assert states[0]["step"] is not other[0]["step"] and states[0]["step"].item() == 3.0
    assert gradrep.join(masters, states, keys) == pieces
    with pytest.raises(ValueError, match="does not match its state names"):
        gradrep.ward_state(pieces[:4], keys, other)
    with pytest.raises(ValueError, match=r"left no \['momentum_buffer'\] state"):
        gradrep.join(masters, [states[0], {}], keys)


OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": LR}),
    "adamw": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1, "amsgrad": True}),
    "sgd": (torch.optim.SGD, {"lr": LR, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2])
def test_replay_gives_the_update_the_optimizer_made_bit_for_bit(name, stage):
    """A replica of the shard before each update, with the gradient and hyperparameters the hook
    saw, replayed: the same bits as the shard after the ZeroOptimizer's own update, from the first
    update (state created) on, with the learning rate changed by a scheduler between steps and
    two groups of different learning rates."""
    cls, kwargs = OPTIMIZERS[name]
    model = make_model()
    params = list(model.parameters())
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    opt = ZeroOptimizer(cls, [{"params": params[:2]}, {"params": params[2:], "lr": LR * 3}], stage=stage,
                        comm=comm, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []

    def hook(o):
        masters = [g.master.clone() for g in o.groups]
        states = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in o.shard_state(gi).items()}
                  for gi in range(len(o.groups))]
        grads = [None if g.master.grad is None else g.master.grad.clone() for g in o.groups]
        seen.append((masters, states, grads, o.update_hyperparams()))
    handle = opt.register_update_pre_hook(hook)
    for step in range(4):
        opt.zero_grad()
        local_loss(model, step, 0, 1).backward()
        opt.step()
        masters, states, grads, hp = seen[-1]
        after = replay_update(opt.optimizer, masters, states, grads, hp)
        for gi, g in enumerate(opt.groups):
            assert torch.equal(masters[gi], g.master), (step, gi)
            live = opt.shard_state(gi)
            assert sorted(after[gi]) == sorted(live)
            for k, v in live.items():
                assert torch.equal(torch.as_tensor(after[gi][k]), torch.as_tensor(v)), (step, gi, k)
        sched.step()
    assert len(seen) == 4 and seen[1][3][0]["lr"] == LR / 2 and seen[3][3][1]["lr"] == LR * 3 / 8
    handle.remove()
    opt.zero_grad()
    local_loss(model, 4, 0, 1).backward()
    opt.step()
    assert len(seen) == 4


def test_replay_leaves_the_optimizer_alone():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(a))
    x, y = torch.zeros(5), torch.ones(3)
    hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    st, none = replay_update(opt, [x, y], [{}, {}], [torch.ones(5), None], [{**hp, "lr": 0.5}, hp])
    assert calls == [] and opt.state_dict()["state"] == {} and opt.param_groups[0]["lr"] == LR
    assert float(st["step"]) == 1.0 and torch.allclose(x, torch.full((5,), -0.5)) and x.grad is None
    assert none == {} and torch.equal(y, torch.ones(3))     # no gradient: left alone, as step() does
    with pytest.raises(ValueError, match="one master, state, gradient and hyperparameter dict per group"):
        replay_update(opt, [x], [], [None], [{}])


def test_replicate_option_is_checked():
    """``replicate`` takes "state" (the default) or "gradient", and "gradient" only with a
    ZeroOptimizer of a plain torch optimizer (a buddy cannot replay 1-bit Adam's collective step
    or a plain optimizer it does not hold); the error names what was given."""
    import compressed
    import elastic

    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    assert elastic.TorchState(model=model, optimizer=torch.optim.Adam(model.parameters())).replicate == "state"
    with pytest.raises(ValueError, match=r"expected replicate one of \('state', 'gradient'\), got 'grad'"):
        elastic.TorchState(model=model, replicate="grad")
    with pytest.raises(ValueError, match="needs a zero.ZeroOptimizer of a plain torch optimizer.*got Adam"):
        elastic.TorchState(model=model, optimizer=torch.optim.Adam(model.parameters()), replicate="gradient")
    onebit = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=2, comm=comm, lr=LR)
    with pytest.raises(ValueError, match="got ZeroOptimizer of OnebitAdam"):
        elastic.TorchState(model=model, optimizer=onebit, replicate="gradient")
    onebit.close()
    state = elastic.TorchState(model=model, optimizer=ZeroOptimizer(torch.optim.Adam, model.parameters(),
                                                                    stage=1, comm=comm, lr=LR),
                               replicate="gradient")
    with pytest.raises(AttributeError, match="replicate is fixed at construction"):
        state.replicate = "state"
