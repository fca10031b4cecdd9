"""The agreements a commit and the end of ``train`` make under ULFM, matched by the recovery.

ULFM promises a uniform outcome only for ``agree``: a collective can complete on some survivors
and fail on others. A commit that must happen on every survivor or on none (one that replays
the ward's update, or one that overwrites the only slot in shared memory) agrees over the
optimizer's communicator first; it says True only where every rank took part (a rank that
failed unseen fails it: commits through shared memory exchange nothing that would meet the
failure, and the survivors would go on committing past the copy they hold of its shard). Every
rank then owes that communicator one agreement per commit;
a recovery that starts before it joins it with False (``close``), so a survivor waiting inside
a commit's agreement is let out, and every rank makes the same agreements in the same order:
the epoch opens again only where every survivor knows the same (after an agreement that said
True, or at the end of a recovery). Leaving ``train`` is agreed the same way (``leave``), over the
ZeroOptimizer's communicator or the state's: ``train`` returns on every survivor or on none, so a
survivor still inside the last commit when a rank fails is never left to recover alone."""
from __future__ import annotations

from typing import Any

from mpicomm import RankFailedError


class CommitAborted(RankFailedError):
    """A commit's agreement said that another rank could not commit (a rank failed)."""


def open(state: Any) -> None:  # noqa: A001 - the epoch opens and closes
    """Let the next commit (a ZeroOptimizer's) or the end of ``train`` agree over the
    ZeroOptimizer's communicator, or else the state's (under ULFM)."""
    comm = state.optimizer.comm if state.sharded else state.comm
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
    if not comm.agree(ok, every_rank=True):
        raise CommitAborted(f"elastic: commit {gen} did not happen on every rank (a rank failed); "
                            f"rolling back to commit {state.generation}")
    state._epoch = comm
    return True


#: The bits of a growth's agreement at a commit (``poll``) besides "got here" (1).
_READY, _KEEP = 2, 4


def poll(state: Any, ready: bool, keep: bool) -> tuple[bool, bool]:
    """One more agreement at a commit while replacements start (``elastic.grow.poll``): whether
    every survivor is ``ready`` (every replacement said so to it) and ``keep`` (it saw none fail),
    the same on every survivor.
    Raises ``CommitAborted`` where a rank did not get here (it is recovering, or it failed)."""
    comm = state._epoch
    if comm is None:
        return False, True
    state._epoch = None
    bits = comm.agree_bits(1 | (_READY if ready else 0) | (_KEEP if keep else 0), every_rank=True)
    if not bits & 1:
        raise CommitAborted(f"elastic: a rank failed while replacements started; rolling back to commit "
                            f"{state.generation}")
    state._epoch = comm
    return bool(bits & _READY), bool(bits & _KEEP)


def leave(state: Any) -> None:
    """The end of ``train`` (collective): returns where every survivor got there and none knows of
    a failed rank; else raises ``CommitAborted`` (the survivors go through a recovery together,
    and ``train`` runs again from the newest commit they all hold)."""
    comm = state._epoch
    if comm is None:
        return
    state._epoch = None
    # first: every survivor got here (one inside a recovery says False); then: none knows of a
    # failure (one that the first agreement met is known to every survivor after it)
    if not (comm.agree(True) and comm.agree(not comm.failed_ranks())):
        raise CommitAborted(f"elastic: a rank failed as train() ended; rolling back to commit {state.generation}")
    state._epoch = comm
