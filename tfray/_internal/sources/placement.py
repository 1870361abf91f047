"""Where an epoch's producers run: on nodes that offer CPUs, in proportion to them.

Producers reserve no CPU (generators.py says why), so Ray would place them
on any node, one started with ``--num-cpus=0`` to keep work off it (a
trainer's) as readily as another: its ``SPREAD`` orders nodes by a hash of
their ids. tfray picks each producer's node itself, by Ray's convention
that the CPUs a node offers say how much work it takes: among the alive
nodes that offer CPUs, the next producer goes where the epoch's running
producers per CPU are fewest (ties to the node of more CPUs, then of the
lower id: the same cluster places an epoch the same way). The affinity is
soft: should its node go, Ray places the producer elsewhere.

``producers_on`` narrows the nodes (``PRODUCERS_ON``):

- ``"cluster"``: every node that offers CPUs, the trainer's included;
- ``"other_nodes"``: every such node but the trainer's (this process's);
- ``"this_node"``: the trainer's node alone, whatever it offers.

A user who gives Ray's own placement in ``ray_remote_args`` (a
``scheduling_strategy``, a ``placement_group``, custom ``resources`` or a
``label_selector``) is followed as given: tfray places nothing then. Where
no node qualifies, producers are left to Ray's ``SPREAD``, with a warning.
"""

import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tfray._internal.runtime import ray_api

logger = logging.getLogger("tfray")

PRODUCERS_ON = ("cluster", "other_nodes", "this_node")
# ray_remote_args that say where a task goes: Ray's to follow.
RAYS_OWN = ("scheduling_strategy", "placement_group", "resources", "label_selector")


# (kind, producers_on) -> when this process may warn of it again.
_warned = {}
WARN_EVERY_S = 60.0


def check(producers_on):
    if producers_on not in PRODUCERS_ON:
        raise ValueError(f"producers_on: expected one of {', '.join(map(repr, PRODUCERS_ON))}, got {producers_on!r}")
    return producers_on


class Placement:
    """One epoch's producers' nodes: ``place()`` as each starts, ``release(node)`` as it ends.

    Args:
        producers_on: one of ``PRODUCERS_ON``.
        ray_remote_args: the user's producer options (see the module's docstring).
        kind: the source's kind, for the warning.
    """

    def __init__(self, producers_on, ray_remote_args, kind):
        self._cpus = {}  # Node id -> CPUs it offers; empty: Ray places.
        self._running = {}  # Node id -> the epoch's producers running there.
        if any((ray_remote_args or {}).get(name) is not None for name in RAYS_OWN):
            return
        here = ray_api.call(lambda: ray.get_runtime_context().get_node_id())
        if producers_on == "this_node":
            self._cpus = {here: 1.0}
        else:
            self._cpus = {
                n["NodeID"]: n["Resources"].get("CPU", 0.0)
                for n in ray_api.call(ray.nodes)
                if n["Alive"]
                and n["Resources"].get("CPU", 0.0) > 0
                and (producers_on == "cluster" or n["NodeID"] != here)
            }
        now = time.monotonic()
        if not self._cpus and now >= _warned.get((kind, producers_on), 0.0):
            # At most once a minute: every epoch (every unit, sharded dynamically) would say it again.
            _warned[(kind, producers_on)] = now + WARN_EVERY_S
            logger.warning(
                "%s: no alive node offers CPUs%s (producers_on=%r); the producers are "
                "left to Ray's SPREAD, which may place them on a node that offers none.",
                kind,
                "" if producers_on == "cluster" else " besides the trainer's",
                producers_on,
            )

    def place(self):
        """The scheduling options of the next producer, and its node (None: Ray places it)."""
        if not self._cpus:
            return {}, None
        node = min(
            self._cpus,
            key=lambda n: ((self._running.get(n, 0) + 1) / self._cpus[n], -self._cpus[n], n),
        )
        self._running[node] = self._running.get(node, 0) + 1
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}, node

    def release(self, node):
        """The producer placed on ``node`` ended."""
        if node is not None:
            self._running[node] -= 1
