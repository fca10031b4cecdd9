"""What a commit holds on one rank, and the chunked copy that fills it while transfers travel."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import values


@dataclass
class Commit:
    """One commit as this rank holds it."""

    gen: int
    count: int = 0                        # user commits since the run began (checkpoint_every counts them)
    stride: int = 1                       # sharded state: the replica is on the rank this many on
    world: int = 1                        # ranks of the communicator it was made over (the old layout)
    model: Any = None                     # model.state_dict() copy (replicated)
    optimizer: Any = None                 # plain optimizer: state_dict() copy (replicated)
    hyper: Any = None                     # ZeroOptimizer: its param_groups' hyperparameters (replicated)
    attrs: dict[str, Any] = field(default_factory=dict)
    rng: Any = None                       # the global torch / numpy / random generators' states
    own: list[torch.Tensor] = field(default_factory=list)      # ZeroOptimizer: this rank's shard pieces
    ward: list[torch.Tensor] = field(default_factory=list)     # ZeroOptimizer: the previous rank's pieces
    # ZeroOptimizer of a plain torch optimizer (replicated by gradient, elastic.gradrep):
    own_live: bool = False                # ``own`` is the live shard itself (no update since this commit)
    own_copy: list[torch.Tensor] = field(default_factory=list)  # what ``own`` is copied into before an update
    grad: list[torch.Tensor] = field(default_factory=list)      # the ward's gradient of the first update since
    grad_hp: Any = None                   # (the ward's hyperparameters, which groups had a gradient) of that update
    updates: int = 0                      # shard updates since this commit
    comm: Any = None                      # the ZeroOptimizer's communicator it was made over
    kind: str = "state"                   # "state", or a ZeroOptimizer's "gradient" / "full" (elastic.gradrep)
    other: list[dict[str, Any]] = field(default_factory=list)  # ZeroOptimizer: per group, its non-elementwise state
    keys: list[list[str]] = field(default_factory=list)        # ZeroOptimizer: per group, its elementwise state names
    fsdp: Any = None                      # FSDP2 model: elastic.fsdp.commit's packed shards and the rest
    own_shm: Any = None                   # elastic.shm.Segment ``own`` lies in (mapped by the buddy)
    ward_shm: Any = None                  # elastic.shm.Segment ``ward`` is mapped from (the ward's own copy)
    ward_live: list[torch.Tensor] = field(default_factory=list)  # its live shard, when it is kept there
    new_segments: bool = False            # this commit set the shared memory up (a collective: see sharded)

    def nbytes(self) -> int:
        """Bytes of tensors this commit holds (a ward's copy mapped from shared memory is the
        ward's, counted there)."""
        own = [] if self.own_live or self.own is self.own_copy else self.own    # the live shard is not a copy
        ward = [] if self.ward_shm is not None else self.ward
        return (values.nbytes(self.model) + values.nbytes(self.optimizer) + values.nbytes(self.attrs)
                + values.nbytes(own) + values.nbytes(self.own_copy) + values.nbytes(ward)
                + values.nbytes(self.grad) + values.nbytes(self.fsdp))

    def ward_pieces(self) -> list[torch.Tensor] | None:
        """The ward's shard at this commit, for when the ward is lost; None when this rank holds
        no whole copy of it. A copy mapped from shared memory must say it holds this commit
        (the ward may have overwritten it with a later commit, or died writing it); where the
        ward's live shard is kept there too and the ward died writing this very commit, or after
        agreeing to it and before writing (its slot still holding the commit before, in segments
        that held one), that live shard is what the copy was of (nothing changes it between a
        step and its commit)."""
        seg = self.ward_shm
        if seg is None:
            return self.ward
        if seg.holds(self.gen):
            return self.ward
        if self.ward_live and (seg.writing(self.gen) or (self.gen > 1 and seg.holds(self.gen - 1))):
            # it died writing this commit, or after the commit's agreement (elastic.epoch), which
            # it joined at the end of the step, before it began writing: its live shard is it
            return self.ward_live
        return None


#: Elements copied between two tests of the exchange in flight (each test moves it along).
COPY_CHUNK = 1 << 20


def buffers_like(tensors: list[torch.Tensor], reuse: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers shaped as ``tensors``: those of ``reuse`` where they match, else fresh ones."""
    olds = reuse if len(reuse) == len(tensors) else [None] * len(tensors)
    return [o if o is not None and o.shape == t.shape and o.dtype == t.dtype and o.device == t.device
            and o.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, o in zip(tensors, olds)]


def copy_polling(dst: list[torch.Tensor], src: list[torch.Tensor], works: list[Any]) -> None:
    """Copy ``src`` into ``dst`` in chunks, testing the transfers ``works`` between chunks so that
    MPI moves them on while the copy runs (no progress thread needed)."""
    pending = list(works)
    for d, t in zip(dst, src):
        d, t = d.view(-1), t.reshape(-1)
        for lo in range(0, t.numel(), COPY_CHUNK):
            d[lo:lo + COPY_CHUNK].copy_(t[lo:lo + COPY_CHUNK])
            while pending and pending[0].is_completed():
                pending.pop(0)
