"""The one place that loads tfray's native library.

The same shared object holds the TfrayDataset op and kernel and the pybind11
bindings of the channel. ``tf.load_op_library`` only records the ops that get
registered while *it* loads the file, so it must load the library before the
Python import does; the import then finds the same, already loaded object and
both share one source registry and one release queue.
"""

import functools
import importlib
import importlib.util
import types

REBUILD_COMMAND = "pip install --no-build-isolation --no-deps --force-reinstall ."


def _rebuild_hint():
    return (
        "Rebuild tfray against the TensorFlow you run: in the tfray source "
        f"directory, with that TensorFlow installed, run `{REBUILD_COMMAND}` "
        "(or `make build` for an in-place build)."
    )


@functools.lru_cache(maxsize=None)
def load():
    """Loads and caches the native library.

    Returns:
        A namespace with ``ops`` (the generated op wrappers) and ``lib`` (the
        pybind11 module).

    Raises:
        ImportError: the library is missing or was built for another
            TensorFlow; the message says how to rebuild.
    """
    import tensorflow as tf

    spec = importlib.util.find_spec("tfray._native")
    try:
        build_info = importlib.import_module("tfray._build_info")
    except ImportError:
        build_info = None
    if spec is None or build_info is None:
        raise ImportError("tfray's native library is not built. " + _rebuild_hint())
    check_tf_version(build_info.TF_VERSION, tf.__version__)
    try:
        ops = tf.load_op_library(spec.origin)
    except tf.errors.NotFoundError as e:
        raise ImportError(
            f"tfray's native library could not be loaded ({e}). " + _rebuild_hint()
        ) from e
    lib = importlib.import_module("tfray._native")
    check_tf_version(lib.built_tf_version(), tf.__version__)
    return types.SimpleNamespace(ops=ops, lib=lib)


def check_tf_version(built, running):
    """Raises ImportError unless the library was built for ``running``."""
    if built != running:
        raise ImportError(
            "tfray's native library was built for TensorFlow "
            f"{built}, but TensorFlow {running} is installed: expected "
            f"{built}, got {running}. " + _rebuild_hint()
        )
