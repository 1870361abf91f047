"""tfray: feed TensorFlow from Ray's object store, zero-copy and GIL-free."""

from tfray._internal.runtime.native import load as _load_native

_load_native()  # Fails here, with how to rebuild, if built for another TF.

from tfray._version import __version__  # noqa: E402
from tfray.dataset import Dataset  # noqa: E402
from tfray.sharding import DynamicSharding  # noqa: E402
from tfray.stats import IteratorStats  # noqa: E402

__all__ = ["Dataset", "DynamicSharding", "IteratorStats", "__version__"]
