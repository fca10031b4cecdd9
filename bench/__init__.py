"""MPI benchmark programs for mpicomm: ``python -m bench PROGRAM`` (see bench/README.md).

Programs: ``collectives`` (mpicomm vs mpi4py vs gloo; dtypes, devices, rounds), ``compressed``
(1-bit allreduce), ``ckpt`` (sharded checkpoints vs DeepSpeed), ``train`` (DDP steps, loss
curves), ``zero`` (ZeroOptimizer vs DDP and FSDP2), ``demo``, ``netsim`` (simulated hosts) and ``plot``
(saved JSON runs). Shared pieces: ``common`` (arguments, timing, and the ``Reporter``: header,
tables, JSON writer, plot, the one output path of every program), ``records`` (record fields,
rounds, validation), ``plot`` (figures), ``values`` (numpy check values), ``env`` (gloo group,
child-process environment), ``arguments`` (comma lists), ``memory`` (resident memory),
``models`` (the benchmark models).
"""
