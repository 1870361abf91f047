"""Turns what Ray raises into the TF error a user sees from ``next()``."""

import re

import ray
import ray.exceptions

from tfray._internal.runtime import ray_api
from tfray._internal.runtime.status import BatchError, Code, EpochError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_running():
    return ray.is_initialized()


def session():
    """Which Ray session this process is in: its objects and tasks belong to it."""
    context = ray_api.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


# Refs and producers die with the Ray session that made them: a new
# ray.init() cannot bring them back, so the advice is to rebuild.
_REBUILD = (
    "Its objects and producers went with that Ray session: after ray.init(), "
    "build a new tfray.Dataset from new refs, producers or Ray Data dataset, "
    "and iterate that."
)


def shutdown_error(where="this iterator", *, reading=True):
    """The error of an epoch that finds Ray shut down; ``where`` names its dataset."""
    when = "while it was reading" if reading else "before it started"
    return EpochError(Code.UNAVAILABLE, f"tfray: {where}: Ray was shut down {when}. {_REBUILD}")


def stale_session_error(where):
    """The error of a new epoch of a dataset built before Ray was restarted."""
    return EpochError(
        Code.UNAVAILABLE,
        f"tfray: {where}: this dataset was built in a Ray session that has since "
        f"been shut down. {_REBUILD}",
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
