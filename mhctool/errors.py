"""Errors the CLI turns into one sentence and exit code 2."""


class UsageError(ValueError):
    """Bad input from the user: an unknown name, a malformed value, a missing file."""
