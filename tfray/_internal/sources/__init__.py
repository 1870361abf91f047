"""What a tfray dataset reads: one module per kind of source."""

from tfray._internal.sources.base import (
    UNKNOWN_CARDINALITY,
    Source,
    as_int,
    ensure_ray,
    positive_int,
)
from tfray._internal.sources.generators import GeneratorSource
from tfray._internal.sources.ray_data import RayDataSource
from tfray._internal.sources.refs import RefsSource

__all__ = [
    "UNKNOWN_CARDINALITY",
    "GeneratorSource",
    "RayDataSource",
    "RefsSource",
    "Source",
    "as_int",
    "ensure_ray",
    "positive_int",
]
