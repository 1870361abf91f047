"""Options of ``sharding="dynamic"`` (public as ``tfray.DynamicSharding``): the distribute layer reads them."""

import dataclasses
import typing


@dataclasses.dataclass(frozen=True)
class DynamicSharding:
    """``sharding="dynamic"`` with options: ``sharding=tfray.DynamicSharding(...)``.

    Attributes:
        name: the dataset's name: worker processes that build datasets of
            the same name (in one Ray cluster) share its work units. None
            derives it from the dataset: its refs' ids (``from_refs``), or
            the generator function's module and name and the shards
            (``from_generators``). Give a name when each worker makes its own
            refs (the ids then differ) or to keep two equal datasets apart.
        lease_timeout_s: a worker whose process has not renewed its lease
            for this long (it died, or stalled so badly that its heartbeat
            thread could not run) loses its unfinished units to the others.
            Live workers renew every ``lease_timeout_s / 4``. The first
            worker to reach the coordinator sets it for all.
    """

    name: typing.Optional[str] = None
    lease_timeout_s: float = 10.0

    def __post_init__(self):
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise TypeError(f"DynamicSharding.name: expected a non-empty str or None, got {self.name!r}")
        if isinstance(self.lease_timeout_s, bool) or not isinstance(self.lease_timeout_s, (int, float)):
            raise TypeError(
                f"DynamicSharding.lease_timeout_s: expected seconds, got {type(self.lease_timeout_s).__name__}"
            )
        if not self.lease_timeout_s > 0:
            raise ValueError(f"DynamicSharding.lease_timeout_s: expected > 0, got {self.lease_timeout_s}")
