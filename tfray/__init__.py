"""tfray: feed TensorFlow from Ray's object store, zero-copy and GIL-free."""

from tfray._internal.runtime.native import load as _load_native

_load_native()  # Fails here, with how to rebuild, if built for another TF.

from tfray._internal.distribute.dynamic import DynamicSharding  # noqa: E402
from tfray._internal.runtime.stats import IteratorStats  # noqa: E402
from tfray.dataset import Dataset  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Dataset", "DynamicSharding", "IteratorStats", "__version__"]
