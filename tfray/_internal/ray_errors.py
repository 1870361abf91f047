"""Turns what Ray raises into the TF error a user sees from ``next()``."""

import re

import ray
import ray.exceptions

from tfray._internal.status import BatchError, Code, EpochError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_running():
    return ray.is_initialized()


def shutdown_error():
    return EpochError(
        Code.UNAVAILABLE,
        "tfray: Ray was shut down while this iterator was reading. Call "
        "ray.init() again (or let tfray start a local Ray) and create a new "
        "iterator.",
    )


def translate(error, where):
    """A BatchError (or EpochError) for ``error`` raised while reading ``where``."""
    if not ray_running():
        return shutdown_error()
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause if error.cause is not None else error
        details = _ANSI.sub("", str(error))
        return BatchError(
            Code.UNKNOWN,
            f"tfray: {where}: the Ray task that produced it raised "
            f"{type(cause).__name__}: {cause}\n{details}",
        )
    if isinstance(error, ray.exceptions.ObjectLostError):
        return BatchError(
            Code.DATA_LOSS,
            f"tfray: {where}: its Ray object is lost or was freed "
            f"({type(error).__name__}): {_ANSI.sub('', str(error)).strip()}",
        )
    if isinstance(error, ray.exceptions.RaySystemError) and isinstance(
        error.client_exc, Exception
    ):  # Ray wraps what unpickling the object raised: this batch is bad, not Ray.
        cause = error.client_exc
        return BatchError(
            Code.INVALID_ARGUMENT,
            f"tfray: {where}: its Ray object cannot be deserialized in this process "
            f"({type(cause).__name__}: {cause}). A batch is a numpy array or a dict / "
            "tuple / list nest of them; anything else it holds must be importable here.",
        )
    if isinstance(error, ray.exceptions.RaySystemError):
        return EpochError(
            Code.UNAVAILABLE,
            f"tfray: {where}: Ray failed ({type(error).__name__}): {error}",
        )
    return BatchError(
        Code.UNKNOWN,
        f"tfray: {where}: reading it from Ray raised {type(error).__name__}: {error}",
    )
