"""Options of ``sharding="dynamic"``: ``tfray.DynamicSharding``."""

from tfray._internal.sharding import DynamicSharding

__all__ = ["DynamicSharding"]
