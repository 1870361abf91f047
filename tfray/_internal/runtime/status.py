"""Errors that take a batch's place, with the status codes of the native channel."""

from tfray._internal.runtime import native

# Defined once, in channel.h (absl::StatusCode numbers), and exported from there.
Code = native.load().lib.Code


class BatchError(Exception):
    """A batch that cannot be delivered; becomes a TF error from ``next()``."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = Code(code)
        self.message = message


class EpochError(BatchError):
    """Like BatchError, but nothing more can be read in this epoch."""
