"""hvd.elastic: Horovod Elastic's PyTorch names on the ``elastic`` package (one job under
``mpirun --with-ft ulfm``: a lost rank is survived in place, replacements are spawned up to
``max_world_size``; no driver, no Gloo). Imported when ``hvd.elastic`` is first used."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

import elastic as _elastic

from . import basics
from .errors import HorovodInternalError, hosts_updated_interrupt

HostsUpdatedInterrupt = hosts_updated_interrupt()

__all__ = ["run", "TorchState", "ObjectState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]


def run(func: Callable | None = None, **kwargs: Any):
    """``@hvd.elastic.run`` (or ``run(min_world_size=..., max_world_size=...)``): ``func(state,
    ...)`` is called again after each recovery, on the survivors, from the last commit."""
    if func is None:
        return lambda f: run(f, **kwargs)
    return _elastic.run(func, **kwargs) if kwargs else _elastic.run(func)


class TorchState(_elastic.TorchState):
    """Horovod's ``TorchState(model, optimizer, **kwargs)``: ``commit()`` (replicated in memory
    by ``elastic``, and kept here for ``restore()``), ``save()``, ``restore()``, ``sync()``
    (rank 0's values everywhere), ``check_host_updates()``, ``register_reset_callbacks``.
    ``ElasticSampler`` keywords are tracked: their processed indices are gathered at each
    commit and re-split over the ranks after a reset."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        rest = {k: v for k, v in kwargs.items() if k not in samplers}
        if not basics.is_initialized():
            basics.init()
        super().__init__(model=model, optimizer=optimizer, **rest)
        object.__setattr__(self, "_samplers", samplers)
        object.__setattr__(self, "_saved", None)
        for name, s in samplers.items():
            setattr(self, f"sampler_state_{name}", s.state_dict())
        super().register_reset_callbacks([self._hvd_reset])
        self.save()

    def __getattr__(self, name: str) -> Any:
        samplers = self.__dict__.get("_samplers")
        if samplers is not None and name in samplers:
            return samplers[name]
        return super().__getattr__(name)

    # -- Horovod's state API -----------------------------------------------------------------

    def commit(self) -> None:
        """Gather the samplers' progress, commit (replicated), keep a copy, check for new hosts."""
        for name, s in self._samplers.items():
            s.sync_processed()
            setattr(self, f"sampler_state_{name}", s.state_dict())
        super().commit()
        self.save()
        self.check_host_updates()

    def save(self) -> None:
        """Keep a copy of the model, optimizer and attributes in memory (for ``restore``)."""
        self._saved = (
            None if self.model is None else copy.deepcopy(self.model.state_dict()),
            None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
            {k: copy.deepcopy(getattr(self, k)) for k in self._names},
        )

    def restore(self) -> None:
        """Back to the last ``save()`` / ``commit()`` on this rank."""
        model, opt, attrs = self._saved
        if model is not None:
            self.model.load_state_dict(model)
        if opt is not None:
            self.optimizer.load_state_dict(opt)
        for k, v in attrs.items():
            setattr(self, k, copy.deepcopy(v))
        self._load_samplers()

    def sync(self) -> None:
        """Rank 0's model, optimizer state and attributes on every rank."""
        from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k, v in broadcast_object({k: getattr(self, k) for k in self._names}, 0).items():
            setattr(self, k, v)
        self._load_samplers()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when hosts were added (elastic's
        discovery, ``MPICOMM_ELASTIC_HOSTS``); nothing to check when it is unset."""
        super().check_host_updates()

    # -- after a recovery ---------------------------------------------------------------------

    def _hvd_reset(self) -> None:
        """Horovod again on the ranks training now (first of the reset callbacks), then the
        samplers re-split, the optimizer's gradient buckets emptied, and the state that the
        recovery or the join set kept for ``restore()`` (a replacement has no other)."""
        basics.abandon()
        basics.init(comm=self.comm)
        reset = getattr(self.optimizer, "_reset_buckets", None)
        if reset is not None:
            reset()
        self._load_samplers()
        self.save()

    def _load_samplers(self) -> None:
        for name, s in self._samplers.items():
            s.load_state_dict(getattr(self, f"sampler_state_{name}"))


class ObjectState(TorchState):
    """Horovod's ``ObjectState(**kwargs)``: plain attributes, committed, saved and synced."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs: Any) -> None:
        super().__init__(model=None, optimizer=None, **kwargs)


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``: this rank's share of the
    epoch's (shuffled) indices not processed yet; ``record_batch`` / ``record_indices`` mark
    progress, a commit gathers every rank's, and a reset re-splits the rest over the ranks."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, bool(shuffle), int(seed)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self._new: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.processed_indices = set()
        self._new = []
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.record_indices(self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size])

    def record_indices(self, indices) -> None:
        new = [int(i) for i in indices]
        self._new.extend(new)
        self.processed_indices.update(new)

    def sync_processed(self) -> None:
        """Every rank's processed indices here (collective; at each commit)."""
        from .functions import allgather_object
        for part in allgather_object(sorted(self._new)):
            self.processed_indices.update(part)
        self._new = []

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(int(i) for i in state["processed_indices"])
        self._new = []
        self.reset()

    def reset(self) -> None:
        """Split the indices not processed yet over the current ranks (padded to a multiple)."""
        rank, size = (basics.rank(), basics.size()) if basics.is_initialized() else (0, 1)
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        left = [i for i in order if i not in self.processed_indices]
        if left and len(left) % size:
            left += left[:size - len(left) % size]
        self.indices = left[rank::size]
        self.num_samples = len(self.indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
