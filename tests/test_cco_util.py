"""The project's single helpers: boolean env flags, byte sizes, the launch environment, dtype names."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicomm
from accelerators import flags
from mpicomm import dtypes


@pytest.mark.parametrize("text,value", [("1", True), (" TRUE ", True), ("yes", True), ("On", True),
                                        ("0", False), ("false", False), ("NO", False),
                                        ("off", False)])
def test_env_flag_values(text, value):
    assert flags.env_flag("X", env={"X": text}) is value
    assert flags.parse_flag(text) is value


def test_env_flag_unset_and_garbage():
    assert flags.env_flag("X", env={}) is False
    assert flags.env_flag("X", default=True, env={"X": "  "}) is True
    assert flags.parse_flag("maybe") is None
    with pytest.raises(ValueError, match=r"X='maybe': expected 0 or 1"):
        flags.env_flag("X", env={"X": "maybe"})


@pytest.mark.parametrize("n,text,compact", [(0, "0 B", "0"), (8, "8 B", "8"), (1023, "1023 B", "1023"),
                                            (1024, "1.0 KiB", "1K"), (1536, "1.5 KiB", "1536"),
                                            (1 << 20, "1.0 MiB", "1M"), (64 << 20, "64.0 MiB", "64M"),
                                            (3 << 30, "3.0 GiB", "3G")])
def test_format_bytes(n, text, compact):
    assert mpicomm.format_bytes(n) == text
    assert mpicomm.format_bytes(n, compact=True) == compact


def test_clean_env_drops_launcher_variables_and_keeps_user_settings():
    env = {"PMI_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MPI_LOCALRANKID": "0", "HYDRA_X": "1",
           "PRTE_LAUNCHED": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "tcp,self", "PATH": "/bin", "MPICOMM_CHECK": "1", "SLURM_LOCALID": "3"}
    got = mpicomm.clean_env(env=env)
    assert got == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMPI_MCA_btl": "tcp,self", "PATH": "/bin", "MPICOMM_CHECK": "1",
                   "SLURM_LOCALID": "3"}
    assert "SLURM_LOCALID" not in mpicomm.clean_env(drop=("SLURM_",), env=env)


def test_dtype_names_round_trip():
    for name, dtype in dtypes.BY_NAME.items():
        assert dtypes.name(dtype) == name and getattr(torch, name) is dtype
    assert dtypes.name(np.float32) == "float32" and dtypes.name(torch.float8_e5m2) == "float8_e5m2"
    assert set(dtypes.BY_NAME) == {"float64", "float32", "float16", "bfloat16", "int64", "int32",
                                   "int16", "int8", "uint8", "bool"}
