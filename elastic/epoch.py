"""The agreement a ZeroOptimizer's commit makes under ULFM, matched by the recovery.

ULFM promises a uniform outcome only for ``agree``: a collective can complete on some survivors
and fail on others. A commit that must happen on every survivor or on none (one that replays
the ward's update, or one that overwrites the only slot in shared memory) agrees over the
optimizer's communicator first. Every rank then owes that communicator one agreement per commit;
a recovery that starts before it joins it with False (``close``), so a survivor waiting inside
a commit's agreement is let out, and every rank makes the same agreements in the same order:
the epoch opens again only where every survivor knows the same (after an agreement that said
True, or at the end of a recovery)."""
from __future__ import annotations

from typing import Any

from mpicomm import RankFailedError


class CommitAborted(RankFailedError):
    """A commit's agreement said that another rank could not commit (a rank failed)."""


def open(state: Any) -> None:  # noqa: A001 - the epoch opens and closes
    """Let the next commit agree over the ZeroOptimizer's communicator (under ULFM)."""
    comm = state.optimizer.comm if state.sharded else None
    state._epoch = comm if getattr(comm, "fault_tolerant", False) else None


def close(state: Any) -> None:
    """At the start of a recovery: join the agreement the next commit would have made, as False
    (collective over the survivors of the ZeroOptimizer's communicator)."""
    comm, state._epoch = state._epoch, None
    if comm is not None:
        comm.agree(False)


def agree(state: Any, comm: Any, ok: bool, gen: int) -> bool:
    """The commit ``gen``'s agreement over ``comm`` (True without ULFM); the epoch opens again
    when every survivor said ``ok``. Raises ``CommitAborted`` where a survivor did not."""
    if state._epoch is not comm:
        return ok
    state._epoch = None
    if not comm.agree(ok):
        raise CommitAborted(f"elastic: commit {gen} did not happen on every rank (a rank failed); "
                            f"rolling back to commit {state.generation}")
    state._epoch = comm
    return True
