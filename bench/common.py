"""The shared surface of the bench programs: each name from the module that owns it.

``bench.sizes`` (byte sizes), ``bench.arguments`` (options every program takes), ``bench.timing``
(OSU schedule, timed loops, bandwidths), ``bench.table`` (columns, tables), ``bench.reporting``
(the ``Reporter``: the one output path of every program, and its JSON writer), ``bench.records``
(record fields, rounds, validation), ``bench.env`` (environment, gloo group, child processes).
The programs import them from here; ``bench/__init__.py`` cannot, because ``bench plot`` and
``bench netsim`` must not start MPI.
"""
from __future__ import annotations

from .arguments import DEFAULT_BUDGET_S, add_common_args, add_rounds_arg, comma_list
from .env import clean_env, environment_info, init_gloo
from .records import make_record, median_round, validate_record
from .reporting import JsonWriter, Reporter, header_lines
from .sizes import format_size, parse_size, parse_sizes
from .table import DEFAULT_COLUMNS, Column, Table, columns
from .timing import (MIN_ITERS, SMALL_WARMUP, bandwidths, busbw_factor, iteration_schedule,
                     time_loop, timed)

__all__ = [
    "DEFAULT_BUDGET_S", "add_common_args", "add_rounds_arg", "comma_list",
    "clean_env", "environment_info", "init_gloo",
    "make_record", "median_round", "validate_record",
    "JsonWriter", "Reporter", "header_lines",
    "format_size", "parse_size", "parse_sizes",
    "DEFAULT_COLUMNS", "Column", "Table", "columns",
    "MIN_ITERS", "SMALL_WARMUP", "bandwidths", "busbw_factor", "iteration_schedule", "time_loop",
    "timed",
]
