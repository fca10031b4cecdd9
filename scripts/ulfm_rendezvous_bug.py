"""Open MPI 5.0.11 under ULFM: a rank that dies with a large message in flight can end a survivor.

Raw mpi4py, no mpicomm: 3 ranks post messages of ``BYTES`` to each other; rank 1 dies with its
sends and receives posted; the survivors see the failure, revoke and shrink, and print ``OK``.
With messages above the TCP transport's eager limit (64 KiB by default: larger ones go by
rendezvous) a survivor crashed inside the shrink (SIGSEGV in
``mca_pml_ob1_recv_request_schedule_once``) or was aborted ("Recv error after request freed",
"Send error after request freed") in about 1 run of 5; below the limit, or with the limit raised
above the message size, no run failed. Every request stays referenced here, so none is freed by
the program. Run it a few times::

    for i in $(seq 10); do OMPI_MCA_btl=tcp,self mpirun --with-ft ulfm -n 3 \\
        python scripts/ulfm_rendezvous_bug.py 4194304 | grep -c OK; done

(2 per run when it survives; ``docs/failures.md`` gives the workaround.)
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

VICTIM = 1


def main() -> None:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 4 << 20
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = comm.Get_rank(), comm.Get_size()
    n = max(1, nbytes // 2)
    src = np.ones(n * size, np.uint16)
    rows = np.zeros((size, n), np.uint16)
    comm.Barrier()
    time.sleep(0.5)  # every rank is past the barrier before the victim dies
    peers = [j for j in range(size) if j != rank]
    posted = [comm.Irecv(rows[j], j, 0) for j in peers]
    posted += [comm.Isend(src[j * n:(j + 1) * n], j, 0) for j in peers]
    if rank == VICTIM:
        os._exit(9)
    try:
        MPI.Request.Waitall(posted)
        raise SystemExit(f"rank {rank}: no error although rank {VICTIM} died")
    except MPI.Exception as exc:
        print(f"rank {rank}: {exc.Get_error_string()}", flush=True)
        try:
            comm.Revoke()
        except MPI.Exception:
            pass  # revoked by a peer already
    survivors = MPI.COMM_WORLD.Shrink()
    total = survivors.allreduce(1)
    print(f"OK rank {rank}: {total} survivors", flush=True)


if __name__ == "__main__":
    main()
