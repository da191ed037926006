"""``mambatrt bundle`` and ``mambatrt compare``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bundle`` and ``compare`` subcommands."""
    from mambatrt.compile import cli as compile_cli

    compile_cli.register(sub)
