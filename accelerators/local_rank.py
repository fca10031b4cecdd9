"""Local rank detection: explicit setting, launcher variables, then a shared-memory split."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Tuple

#: Our own override, read before any launcher variable.
OVERRIDE_VAR = "MPICOMM_LOCAL_RANK"

#: Launcher variables in priority order: (rank variable, local size variable or None).
#: SLURM_LOCALID comes last: ``mpirun`` inside ``sbatch`` inherits the batch step's value.
LAUNCHER_VARS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),                        # MPICH Hydra, Intel MPI
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),    # MVAPICH
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),                          # PMI launchers
    ("PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),                      # Cray PALS
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),                    # srun
)

SHARED_SPLIT_SOURCE = "MPI Split_type(COMM_TYPE_SHARED)"


@dataclass(frozen=True)
class LocalRank:
    """This process's rank among the processes on its node, and where that answer came from."""

    rank: int
    size: Optional[int]
    source: str
    warnings: Tuple[str, ...] = field(default_factory=tuple)

    def device_index(self, device_count: int) -> int:
        """The device this rank should use: local rank modulo the number of visible devices."""
        if device_count < 1:
            raise ValueError(f"device_count must be >= 1, got {device_count}")
        return self.rank % device_count


def _parse_nonneg(text: str) -> Optional[int]:
    try:
        value = int(text.strip())
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None


def _mpi_shared_split() -> Tuple[int, int]:
    """Rank and size in a Split_type(COMM_TYPE_SHARED) of COMM_WORLD (collective)."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def detect_local_rank(
    explicit: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    shared_split: Optional[Callable[[], Tuple[int, int]]] = _mpi_shared_split,
    cross_check: bool = False,
    launcher_vars: Sequence[Tuple[str, Optional[str]]] = LAUNCHER_VARS,
) -> LocalRank:
    """Find the local rank: ``explicit``, MPICOMM_LOCAL_RANK, launcher variables, then MPI.

    ``shared_split`` returns (rank, size) on the node; it is collective, so it is called only when
    no other source answers, or when ``cross_check`` is true (then every rank must call this).
    Pass ``shared_split=None`` to never touch MPI. Disagreeing sources are listed in ``warnings``.
    """
    env = os.environ if env is None else env
    notes: list[str] = []
    # (source, rank, size) for every source that gave a usable answer, in priority order.
    found: list[Tuple[str, int, Optional[int]]] = []

    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 0:
            raise ValueError(f"explicit local rank must be an int >= 0, got {explicit!r}")
        found.append(("explicit", explicit, None))

    override = env.get(OVERRIDE_VAR, "").strip()
    if override:
        value = _parse_nonneg(override)
        if value is None:
            raise ValueError(f"{OVERRIDE_VAR}={override!r}: expected an integer >= 0")
        found.append((OVERRIDE_VAR, value, None))

    for rank_var, size_var in launcher_vars:
        text = env.get(rank_var)
        if text is None:
            continue
        value = _parse_nonneg(text)
        if value is None:
            notes.append(f"ignored {rank_var}={text!r}: not an integer >= 0")
            continue
        size = None
        if size_var is not None and env.get(size_var) is not None:
            size = _parse_nonneg(env[size_var]) or None  # 0 is no size either
        found.append((rank_var, value, size))

    if shared_split is not None and (not found or cross_check):
        try:
            split = shared_split()
        except Exception as exc:  # noqa: BLE001 - MPI missing or unusable: fall back, say why
            notes.append(f"{SHARED_SPLIT_SOURCE} failed: {type(exc).__name__}: {exc}")
        else:
            found.append((SHARED_SPLIT_SOURCE, int(split[0]), int(split[1])))

    if not found:
        notes.append("no explicit setting, launcher variable or MPI answer: assuming local rank 0")
        return LocalRank(0, None, "default", tuple(notes))

    source, rank, size = found[0]
    split = next(((r, s) for src, r, s in found[1:] if src == SHARED_SPLIT_SOURCE), None)
    if size is None:  # take the size from the first lower-priority source that agrees on the rank
        for other_source, other_rank, other_size in found[1:]:
            if other_size is not None and (other_rank == rank or other_source == SHARED_SPLIT_SOURCE):
                size = other_size
                break
    for other_source, other_rank, _ in found[1:]:
        # The split numbers a node's ranks in world-rank order; a launcher may number them in
        # another (Open MPI's by-core mapping gives world 0-3 local 0, 2, 1, 3): both are valid.
        if other_rank != rank and other_source != SHARED_SPLIT_SOURCE:
            notes.append(f"{other_source} says local rank {other_rank} but {source} says {rank}; "
                         f"using {source}")
    if split is not None and size is not None and split[1] != size:
        notes.append(f"{source} says {size} ranks on this node but {SHARED_SPLIT_SOURCE} counts "
                     f"{split[1]}")
    if size is not None and rank >= size:
        notes.append(f"local rank {rank} from {source} is not below the local size {size}")
    return LocalRank(rank, size, source, tuple(notes))


def numbering_problem(ranks: Sequence[int], source: str) -> Optional[str]:
    """A warning when the local ranks of one node's processes (in world-rank order) are not 0..n-1."""
    if sorted(ranks) == list(range(len(ranks))):
        return None
    return (f"the {len(ranks)} processes on this node have local ranks {list(ranks)} (from "
            f"{source}), not each of 0..{len(ranks) - 1} once: two processes may share a device")
