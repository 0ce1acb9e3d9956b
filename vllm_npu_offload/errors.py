"""Exceptions shared by the core and the adapters."""


class OffloadConfigError(ValueError):
    """A user-supplied setting is invalid; the message names the key and what is allowed."""


class CopyError(RuntimeError):
    """A copy call failed; the message names the call and, where known, the descriptor."""

    def __init__(self, message: str, call: str = "", index: int | None = None):
        super().__init__(message)
        self.call = call
        self.index = index
