"""Errors that are the user's input: the CLI prints them in one line and exits 2."""


class UserError(ValueError):
    """Bad input (a spec, a checkpoint, an option); the message says what and where."""


class SpecError(UserError):
    """A spec is invalid. ``path`` is the YAML field path (``decomposition.ranks.k``)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)


class RuntimeFailure(RuntimeError):
    """Something failed while running (a rank died, hung or raised): the CLI prints the
    one-line message; ``details`` holds a traceback, shown with DEINFER_TRACEBACK=1."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details
