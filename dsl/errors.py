"""The one error type of the spec language."""


class SpecError(ValueError):
    """A spec is invalid. ``path`` is the YAML field path (``decomposition.ranks.k``)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)
