"""How a trainer stops its ``from_generators`` producers: asked, not cancelled.

``ray.cancel`` on a streaming-generator task that is completing at that
moment ends the trainer's process (Ray 2.60's core worker checks
"Tried to complete task that was not pending" when the task's reply arrives
after the cancel failed it). A dropped iterator, an epoch that ends early
and spec learning all stop producers that may be completing, so tfray never
cancels one. Instead:

1. the trainer posts the epoch's token on its stop board, a Ray actor
   (``num_cpus=0``, one per trainer process and Ray session, kept by the
   runtime), and waits for the board to have it;
2. it reads and drops what each producer has ready, which resumes a
   producer paused by backpressure (dropping the generator alone resumes it
   only once Ray gets to delete the stream, a second or more later);
3. each producer checks its token as it resumes, and between batches
   (producer.py), and returns: its task completes as any other.
"""

import asyncio
import collections
import logging
import sys
import uuid

import ray
from ray import cloudpickle

from tfray._internal.runtime import ray_api

# By value, like the producers (generators.py): by reference, the actor's
# process would import tfray, and with it TensorFlow.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Stopped tokens remembered for producers whose wait arrives after the stop.
_TOKENS_KEPT = 100_000
# How long a stop waits for the board to take it (an async actor: normally ms).
_STOP_S = 30.0

logger = logging.getLogger("tfray")


@ray.remote(num_cpus=0)
class StopBoard:
    """Tokens the trainer has stopped; a producer's ``wait`` returns once its token is."""

    def __init__(self):
        self._stopped = collections.OrderedDict()
        self._waiting = {}  # token -> asyncio.Event

    async def wait(self, token):
        if token not in self._stopped:
            await self._waiting.setdefault(token, asyncio.Event()).wait()
        return True

    async def stop(self, token):
        self._stopped[token] = None
        while len(self._stopped) > _TOKENS_KEPT:
            self._stopped.popitem(last=False)
        event = self._waiting.pop(token, None)
        if event is not None:
            event.set()


def board(session_actor):
    """This process's stop board in the current Ray session, made on first use.

    ``session_actor``: the runtime's, which keeps one actor of a name per Ray session.
    """
    return session_actor("stop board", _make_board)


def _make_board():
    # Every running producer parks one wait() call here.
    return StopBoard.options(max_concurrency=100_000).remote()


def new_token():
    return uuid.uuid4().hex


def stop(handle, token):
    """Posts ``token`` as stopped; returns once the board has it, or after _STOP_S."""
    reply = ray_api.call(handle.stop.remote, token)
    if ray_api.poll([reply], _STOP_S):  # Never waits in Ray (ray_api).
        ray_api.get(reply)
    else:
        logger.warning(
            "tfray: the stop board did not take a stop within %s s: producers of an "
            "ended epoch may run on until their tasks end",
            _STOP_S,
        )
