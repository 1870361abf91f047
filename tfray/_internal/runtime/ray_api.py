"""The Ray calls tfray's own threads make, without Ray's auto-init.

Ray starts a new local Ray when ``ray.get`` or ``ray.wait`` is
called after ``ray.shutdown()``. From a feeder that would start a Ray
behind the user's back, in the middle of an epoch whose objects went with
the old one; these raise instead, and the feeder reports the shutdown
(``ray_errors.shutdown_error``).
"""

import ray


def _direct(api):
    # Ray wraps its public calls with functools.wraps, which keeps the call.
    return getattr(api, "__wrapped__", api)


get = _direct(ray.get)
wait = _direct(ray.wait)
get_runtime_context = _direct(ray.get_runtime_context)
