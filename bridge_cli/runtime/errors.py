"""Errors raised when the requested run cannot be carried out on this machine."""


class RuntimeUnavailable(Exception):
    """A feature the config asks for cannot run here (e.g. NCCL without a GPU); the message says what to do."""
