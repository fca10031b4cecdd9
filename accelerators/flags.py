"""Boolean settings from the environment: the one parser the project uses (accelerators and mpicomm)."""
from __future__ import annotations

import os
from typing import Mapping, Optional

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def parse_flag(text: str) -> Optional[bool]:
    """True for 1/true/yes/on, False for 0/false/no/off (any case, spaces ignored), else None."""
    low = text.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    return None


def env_flag(name: str, default: bool = False, env: Optional[Mapping[str, str]] = None) -> bool:
    """The boolean environment variable ``name`` (unset or empty: ``default``); raise on other text."""
    text = (os.environ if env is None else env).get(name, "")
    if not text.strip():
        return default
    value = parse_flag(text)
    if value is None:
        raise ValueError(f"{name}={text!r}: expected 0 or 1 (also accepted: true/false, yes/no, "
                         "on/off)")
    return value
