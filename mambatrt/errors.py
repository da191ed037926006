"""Exceptions for problems a user can fix. The CLI turns them into a one-line message and exit code 2."""


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
