"""Options and argument types several commands share."""

from __future__ import annotations

import argparse

from mambatrt.runtime.runners import DEVICE_HELP, DEVICES


def add_quiet_arg(p: argparse.ArgumentParser, what: str) -> None:
    """-q/--quiet, every command's one switch for progress output."""
    p.add_argument("-q", "--quiet", action="store_true", help=what)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device, shared by run, bench, eval and serve."""
    p.add_argument("--device", choices=DEVICES, default="auto", help=f"{DEVICE_HELP} (default: auto)")


def add_bundle_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", metavar="BUNDLE_DIR", help="a bundle built by `mambatrt bundle`")


def token_ids_arg(text: str) -> list[int]:
    """``1,2,3`` -> [1, 2, 3]; anything else is argparse's usage error."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
