"""Status codes shared with the native channel (absl::StatusCode numbers)."""

import enum


class Code(enum.IntEnum):
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15


class BatchError(Exception):
    """A batch that cannot be delivered; becomes a TF error from ``next()``."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = Code(code)
        self.message = message


class EpochError(BatchError):
    """Like BatchError, but nothing more can be read in this epoch."""
