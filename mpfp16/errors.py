"""Errors with a known cause. The scripts print each as one line, with no traceback:
the user's to fix (:class:`UserError` and its kinds) with exit status 2, the others
with exit status 1."""


class UserError(Exception):
    """A problem with the input: a flag, a path, a data set or a checkpoint."""


class DataError(UserError):
    """A data set that is missing, empty or in the wrong format."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, unsafe or from another model."""


class ReplicaDivergenceError(RuntimeError):
    """Data-parallel ranks hold different weights, masters or optimizer state."""


class FusedStepUnavailable(RuntimeError):
    """``fused=True`` was asked for, and the fused step could not be compiled on
    some rank."""
