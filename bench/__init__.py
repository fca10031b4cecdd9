"""MPI benchmark programs for mpicomm: ``python -m bench PROGRAM`` (see bench/README.md).

Programs: ``collectives`` (mpicomm vs mpi4py vs gloo; dtypes, devices, rounds), ``compressed``
(1-bit allreduce; ``--crossover`` in ``crossover``), ``ckpt`` (sharded checkpoints vs DeepSpeed:
``ckpt_deepspeed``, ``ckpt_fsdp2``), ``train`` (DDP steps: ``train_peers``; loss curves:
``train_curve``, ``lamb``), ``zero`` (ZeroOptimizer vs DDP and FSDP2), ``demo``, ``netsim``
(simulated hosts) and ``plot`` (saved JSON runs). Shared pieces, re-exported by ``common``:
``sizes`` (byte sizes), ``arguments`` (common options, comma lists), ``timing`` (OSU schedule,
timed loops, bandwidths), ``table`` (columns, tables), ``reporting`` (the ``Reporter``: header,
tables, JSON writer, plot, the one output path of every program), ``records`` (record fields,
rounds, validation), ``env`` (environment, gloo group, child-process environment); ``plot``
(figures), ``values`` (numpy check values), ``memory`` (resident memory), ``models`` (the
benchmark models).
"""
