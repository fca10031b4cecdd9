"""Training that survives a lost rank in the same job (MPI with ULFM), Horovod Elastic's names.

    import elastic
    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    state.register_reset_callbacks([rebuild_ddp])
    @elastic.run
    def train(state):
        while state.step < steps:
            ...one step...
            state.step += 1
            state.commit()
    train(state)

What lives where:
    state     TorchState: the public state object, its attributes and the commit's outline
    commit    what a commit holds on one rank, and the chunked copy that fills it
    sharded   a ZeroOptimizer's shards in a commit: sent to the buddy or kept in shared memory
    gradrep   a ZeroOptimizer replicated by its gradient (the buddy replays the update)
    epoch     the agreement a ZeroOptimizer's commit makes under ULFM, matched by the recovery
    domains   every rank's failure domain and the replica stride they give
    run       the decorator and the recovery (revoke, shrink, new process group, rollback, callbacks)
    rollback  which generation a recovery rolls back to (every survivor holds it whole), and the rollback
    repartition  how shards move after a loss or a growth: point to point from the ranks holding them
    grow      growing back: spawn replacements at a commit, merge, hand them the state
    wire      a tree of tensors and plain values broadcast without pickle
    replicas  which rank holds whose shard replica (pure)
    reshard   a ZeroOptimizer group's shards joined in parameter order (pure)
    fsdp      FSDP2 state: local DTensor shards committed with a buddy replica, re-partitioned over
              the survivors and loaded into the rebuilt model by RebuildFSDP (a reset callback)
    shm       a ZeroOptimizer shard's committed copies in shared memory, mapped by a buddy on the
              same host (no transfer; MPICOMM_ELASTIC_SHM=0 sends them through MPI)
    sampler   ElasticSampler: a deterministic global batch re-split over the current ranks (pure)
    values    copies of attribute values per commit
    errors    ElasticError and its kinds

Layering: accelerators <- mpicomm <- compressed <- zero <- ckpt <- elastic <- bench.
"""
from __future__ import annotations

from .errors import ElasticError, HostsUpdatedInterrupt, ResetCallbackError, ShardsLostError, WorldTooSmallError
from .fsdp import RebuildFSDP
from .run import recover, run
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticError", "ElasticSampler", "HostsUpdatedInterrupt", "RebuildFSDP", "ResetCallbackError",
           "ShardsLostError", "TorchState", "WorldTooSmallError", "recover", "run"]
