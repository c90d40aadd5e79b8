"""Errors that are the user's to fix. The scripts print them as one line, with no
traceback, and exit with status 2."""


class UserError(Exception):
    """A problem with the input: a flag, a path, a data set or a checkpoint."""


class DataError(UserError):
    """A data set that is missing, empty or in the wrong format."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, unsafe or from another model."""
