"""One exception type for every user-facing failure: the CLI prints its message as one line and exits non-zero."""


class AdvisorError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotBuiltYet(AdvisorError):
    """A sub-command whose stage does not exist yet: say so instead of pretending."""

    exit_code = 3
