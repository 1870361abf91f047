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

A producer that asks for resources (GPUs, custom ones, memory, a label or
a node) waits in Ray's queue until a node offers them, as Ray's tasks do;
an autoscaler sees that demand and may add such a node. ``Watch`` keeps
the wait from being silent: an epoch whose producers no alive node can run
warns, at most once a minute per dataset, says so in ``stats()``, and
fails after ``placement_timeout_s`` if the user set one.
"""

import logging
import numbers
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from tfray._internal.runtime import ray_api
from tfray._internal.runtime.status import Code, EpochError
from tfray._internal.runtime.streams import Unplaced

logger = logging.getLogger("tfray")

PRODUCERS_ON = ("cluster", "other_nodes", "this_node")
# ray_remote_args that say where a task goes: Ray's to follow.
RAYS_OWN = ("scheduling_strategy", "placement_group", "resources", "label_selector")


# A warning's key (its kind and dataset) -> when this process may give it again.
_warned = {}
WARN_EVERY_S = 60.0


def _warn_now(key):
    """Whether to give the warning of ``key`` now: at most once every WARN_EVERY_S.

    Every epoch (every unit, sharded dynamically) would say it again.
    """
    now = time.monotonic()
    if now < _warned.get(key, 0.0):
        return False
    _warned[key] = now + WARN_EVERY_S
    return True


def check(producers_on):
    if producers_on not in PRODUCERS_ON:
        raise ValueError(f"producers_on: expected one of {', '.join(map(repr, PRODUCERS_ON))}, got {producers_on!r}")
    return producers_on


def check_timeout(placement_timeout_s):
    if placement_timeout_s is None:
        return None
    if isinstance(placement_timeout_s, bool) or not isinstance(placement_timeout_s, numbers.Real):
        raise TypeError(
            f"placement_timeout_s: expected None or seconds (a number), got {type(placement_timeout_s).__name__}"
        )
    if not placement_timeout_s > 0:
        raise ValueError(f"placement_timeout_s: expected more than 0 seconds, got {placement_timeout_s!r}")
    return float(placement_timeout_s)


def asks(ray_remote_args):
    """The resources one producer reserves, by Ray's names (tfray reserves no CPU)."""
    args = ray_remote_args or {}
    asked = {name: float(n) for name, n in (args.get("resources") or {}).items() if n}
    if args.get("num_gpus"):
        asked["GPU"] = float(args["num_gpus"])
    if args.get("memory"):
        asked["memory"] = float(args["memory"])
    if args.get("accelerator_type"):
        # How Ray asks for an accelerator type: a sliver of the node's resource.
        asked[f"accelerator_type:{args['accelerator_type']}"] = 0.001
    return asked


def _label_matches(condition, value):
    """Whether a node's label ``value`` (None: it has none) meets one of Ray's label conditions."""
    negated = condition.startswith("!")
    condition = condition[1:] if negated else condition
    if condition.startswith("in(") and condition.endswith(")"):
        met = value in {v.strip() for v in condition[3:-1].split(",")}
    else:
        met = value == condition
    return met != negated


def unplaceable(ray_remote_args):
    """Why no alive node can run a producer with ``ray_remote_args`` now, or None if one can.

    Decided by what each node offers in all, not what is free now: a
    producer that waits for resources other work holds waits as any Ray
    task does, and is not reported.
    """
    args = ray_remote_args or {}
    strategy = args.get("scheduling_strategy")
    group = args.get("placement_group")
    if isinstance(strategy, PlacementGroupSchedulingStrategy):
        group = strategy.placement_group
    if group is not None and group != "default":
        state = ray_api.call(ray.util.placement_group_table, group).get("state")
        # A created group's bundles are reserved: its tasks run there.
        return None if state == "CREATED" else f"their placement group is {state}, not created"
    nodes = [n for n in ray_api.call(ray.nodes) if n["Alive"]]
    where = ""
    if isinstance(strategy, NodeAffinitySchedulingStrategy) and not strategy.soft:
        nodes = [n for n in nodes if n["NodeID"] == strategy.node_id]
        where = f" on node {strategy.node_id}"
        if not nodes:
            return f"their scheduling_strategy needs node {strategy.node_id}, which is not alive"
    selector = args.get("label_selector") or {}
    if selector:
        nodes = [
            n for n in nodes if all(_label_matches(c, (n.get("Labels") or {}).get(k)) for k, c in selector.items())
        ]
        where += f" with labels {selector}"
    asked = asks(args)
    if any(all(n["Resources"].get(name, 0.0) >= amount for name, amount in asked.items()) for n in nodes):
        return None
    return f"each asks {asked or 'no resources'}{where}, which no alive node offers"


class Placement:
    """One epoch's producers' nodes: ``place()`` as each starts, ``release(node)`` as it ends.

    Args:
        producers_on: one of ``PRODUCERS_ON``.
        ray_remote_args: the user's producer options (see the module's docstring).
        name: the dataset, for the warning (``from_generators(read_shard)``).
    """

    def __init__(self, producers_on, ray_remote_args, name):
        self._cpus = {}  # Node id -> CPUs it offers; empty: Ray places.
        self._running = {}  # Node id -> the epoch's producers running there.
        if any((ray_remote_args or {}).get(option) is not None for option in RAYS_OWN):
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
        if not self._cpus and _warn_now(("no CPUs", name, producers_on)):
            logger.warning(
                "%s: no alive node offers CPUs%s (producers_on=%r); the producers are "
                "left to Ray's SPREAD, which may place them on a node that offers none.",
                name,
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


# How long an epoch's producers may make no progress before Watch asks
# whether they can be placed, and how often it asks again while they cannot.
CHECK_S = 5.0


class Watch:
    """Whether one epoch's producers wait for a node that none alive offers.

    The epoch's stream calls ``waited(running, since)`` each time it finds
    no producer ready, ``since`` its last progress (``time.monotonic()``).
    After ``CHECK_S`` with no progress it asks, every ``CHECK_S`` (a read
    of Ray's node table), whether the producers can be placed. While they
    cannot, ``unplaced`` says so (``stats()``; stale once the stream has
    progressed since), a warning names the dataset at most once a minute,
    and past ``timeout_s`` (if not None) ``waited`` raises an
    ``EpochError``, which ends the epoch.

    Args:
        name: the dataset, for messages (``from_generators(read_shard)``).
        ray_remote_args: the user's producer options.
        timeout_s: ``placement_timeout_s``, or None to wait for a node.
    """

    def __init__(self, name, ray_remote_args, timeout_s):
        self._name = name
        self._args = ray_remote_args
        self._timeout_s = timeout_s
        self._check_s = CHECK_S if timeout_s is None else min(CHECK_S, timeout_s)
        self._next_check = 0.0  # No check before then either.
        self.unplaced = None  # An Unplaced when the last check found they cannot be placed.

    def waited(self, running, since):
        """No producer of ``running`` (how many run) was ready since ``since``: checks when due."""
        now = time.monotonic()
        if not running or now < since + self._check_s or now < self._next_check:
            return
        self._next_check = now + self._check_s
        why = unplaceable(self._args)
        if why is None:
            self.unplaced = None
            return
        self.unplaced = Unplaced(running, since)
        waited = now - since
        if self._timeout_s is not None and waited >= self._timeout_s:
            raise EpochError(
                Code.UNAVAILABLE,
                f"{self._name}: {running} producer(s) could not be placed within "
                f"placement_timeout_s={self._timeout_s:g}: {why}. Add a node that offers it, "
                "or ask for less in ray_remote_args.",
            )
        if _warn_now(("waiting", self._name)):
            logger.warning(
                "%s: %d producer(s) have waited %.0f s to be placed: %s. They start when a "
                "node that offers it joins (an autoscaler sees the demand); pass "
                "placement_timeout_s to fail instead of waiting.",
                self._name,
                running,
                waited,
                why,
            )
