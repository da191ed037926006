"""Exceptions for problems a user can fix. The CLI turns them into a one-line message and exit code 2."""

import contextlib
import signal
import threading


class MambatrtError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ConfigError(MambatrtError):
    """A model configuration is missing, malformed or describes an unsupported model."""


class CheckpointError(MambatrtError):
    """A checkpoint file is missing, corrupt, or its tensors do not match the configuration."""


class InputError(MambatrtError):
    """Token ids, row counts, precisions or other arguments are out of range. ``param``: the request field at fault,
    where it is not the prompt (a server names it in its answer)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class BundleError(MambatrtError):
    """A bundle is missing, incomplete, corrupt, or does not match this runtime."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, docker stop, CI cancellation), raised like Ctrl-C so that every cleanup path runs."""


# SIGINT / SIGTERM seen by the command's handlers (mambatrt.cli), each raised where it came. Code running then may
# swallow the exception (seen: torch's lazy imports inside the exporter), so long work calls raise_if_signalled()
# between its stages: a signal stops the work at the next stage at the latest, and its cleanup runs.
_received: list[int] = []


def on_signal(signum: int, frame) -> None:
    """The command's SIGINT / SIGTERM handler: note the signal, raise it (KeyboardInterrupt or Terminated)."""
    _received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def clear_signals() -> None:
    """Forget the signals of an earlier command in this process."""
    _received.clear()


def signalled() -> int | None:
    """The signal that arrived during this command (SIGTERM before SIGINT), or None."""
    return signal.SIGTERM if signal.SIGTERM in _received else _received[0] if _received else None


def raise_if_signalled() -> None:
    """Raise again a signal that arrived during this command (its first exception may have been swallowed)."""
    sig = signalled()
    if sig is not None:
        raise Terminated() if sig == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def noting_interrupts():
    """SIGINT noted as the CLI notes it (:func:`on_signal`) for the length of an API call's long work, where the
    process has Python's own handler (no CLI, no handler of the caller's): a Ctrl-C whose KeyboardInterrupt an import
    swallows still stops the work at its next stage (:func:`raise_if_signalled`)."""
    own = threading.current_thread() is threading.main_thread()
    if not own or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    clear_signals()
    signal.signal(signal.SIGINT, on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
