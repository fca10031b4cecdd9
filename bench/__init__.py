"""MPI benchmark programs for mpicomm: ``python -m bench PROGRAM`` (see bench/README.md).

Programs: ``collectives`` (mpicomm vs mpi4py vs gloo; dtypes, devices, rounds), ``compressed``
(1-bit allreduce), ``ckpt`` (sharded checkpoints vs DeepSpeed), ``train`` (DDP steps, loss
curves), ``demo``, ``netsim`` (simulated hosts) and ``plot`` (saved JSON runs). Shared pieces:
``common`` (arguments, timing, table, JSON writer, reporter), ``records`` (record fields,
rounds, validation), ``plot`` (figures), ``values`` (numpy check values), ``env`` (gloo group,
child-process environment).
"""
