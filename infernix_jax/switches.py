"""Trace-time switches: a mode per name, started from an environment variable and changed for a
block by a context manager. Code that picks an implementation reads the table while a program is
traced, so a switch set around the tracing takes effect (cache.attention_choice, weights.quant)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def env_mode(variable: str, default: str, modes: tuple[str, ...]) -> str:
    """A switch's start value: the environment variable's, else `default`; refused unless in `modes`."""
    mode = os.environ.get(variable, default)
    if mode not in modes:
        raise ValueError(f"{variable} must be one of {', '.join(modes)}; got {mode!r}")
    return mode


@contextlib.contextmanager
def switched(
    table: dict[str, str], name: str, mode: str, modes: tuple[str, ...], what: str
) -> Iterator[None]:
    """`table[name]` set to `mode` inside the block (refused unless in `modes`; `what` names the
    switch in the refusal), restored after."""
    if mode not in modes:
        raise ValueError(f"{what} must be one of {', '.join(modes)}; got {mode!r}")
    previous, table[name] = table[name], mode
    try:
        yield
    finally:
        table[name] = previous
