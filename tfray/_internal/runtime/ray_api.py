"""The Ray calls tfray's own threads make, without Ray's auto-init.

Ray starts a new local Ray when ``ray.get`` or ``ray.wait`` is
called after ``ray.shutdown()``. From a feeder that would start a Ray
behind the user's back, in the middle of an epoch whose objects went with
the old one; these raise instead, and the feeder reports the shutdown
(``ray_errors.shutdown_error``).

They also never block inside Ray: a Ray call that ``ray.shutdown()``
overtakes ends the process in Ray's core worker (and so does touching a
streaming generator after it), so waits are polls (``poll``).
"""

import time

import ray

# How poll's polls back off.
_FIRST_PAUSE_S = 0.0005
_LAST_PAUSE_S = 0.01


def _direct(api):
    # Ray wraps its public calls with functools.wraps, which keeps the call.
    return getattr(api, "__wrapped__", api)


get = _direct(ray.get)
wait = _direct(ray.wait)
get_runtime_context = _direct(ray.get_runtime_context)


def poll(refs, timeout):
    """Those of ``refs`` (ObjectRefs or streaming generators) ready within ``timeout`` s.

    [] if none was; None: no limit. Each poll checks that Ray is up first,
    and raises the shutdown error if not; the polls back off from 0.5 ms
    to 10 ms.
    """
    from tfray._internal.runtime import ray_errors  # It imports this module.

    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _FIRST_PAUSE_S
    while True:
        if not ray_errors.ray_running():
            raise ray_errors.shutdown_error()
        ready, _ = wait(refs, num_returns=len(refs), timeout=0)
        left = None if deadline is None else deadline - time.monotonic()
        if ready or (left is not None and left <= 0):
            return ready
        time.sleep(pause if left is None else min(pause, left))
        pause = min(2 * pause, _LAST_PAUSE_S)
