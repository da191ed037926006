"""The ``mambatrt`` command: argparse subcommands, each imported only when it runs (so ``run`` needs no torch)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from mambatrt import __version__
from mambatrt.errors import MambatrtError, Terminated, clear_signals, on_signal, signalled


def add_quiet_arg(p: argparse.ArgumentParser, what: str) -> None:
    """-q/--quiet, every command's one switch for progress output (``--no-progress`` is its old spelling)."""
    p.add_argument("-q", "--quiet", action="store_true", help=what)
    p.add_argument("--no-progress", dest="quiet", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="mambatrt",
        description="Mamba-1 language models: checkpoint -> ONNX -> TensorRT plans -> fast generation.",
    )
    parser.add_argument("--version", action="version", version=f"mambatrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from mambatrt.compile import cli as compile_cli
    from mambatrt.runtime import cli as runtime_cli

    for module in (compile_cli, runtime_cli):
        module.register(sub)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    """Entry point: run a subcommand; user errors print one line and return 2, SIGINT 130, SIGTERM 143."""
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    clear_signals()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return int(args.func(args) or 0)
    except MambatrtError as exc:
        print(f"mambatrt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"mambatrt {args.command}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"mambatrt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # after a signal, an error is its consequence (a library half-imported when the KeyboardInterrupt hit it):
        # the command was interrupted, and cleaned up on the way out; without one, a bug keeps its traceback
        if signalled() is None:
            raise
        term = signalled() == signal.SIGTERM
        print(f"mambatrt {args.command}: {'terminated' if term else 'interrupted'}", file=sys.stderr)
        return 143 if term else 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
