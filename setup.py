"""Builds tfray's native library against the TensorFlow installed here.

TensorFlow is not a declared requirement: the library must be compiled
against the exact TensorFlow the user runs (CPU or GPU build), so it is
imported from the build environment instead. Build without isolation:

    pip install --no-build-isolation .
"""

import os
import re
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NO_TF_MESSAGE = """
tfray compiles its native library against the TensorFlow you run, so
TensorFlow must be importable while tfray builds. Got: {error}

Install TensorFlow first (e.g. `pip install tensorflow`), then build tfray
in the same environment without build isolation, which would otherwise
install a second, different TensorFlow just for the build:

    pip install --no-build-isolation .
"""


def _tensorflow():
    try:
        import tensorflow as tf
    except ImportError as e:
        sys.exit(NO_TF_MESSAGE.format(error=e))
    return tf


class BuildNative(build_ext):
    """Adds TensorFlow's own compile and link flags (ABI, -std, include)."""

    def build_extensions(self):
        import pybind11

        tf = _tensorflow()
        major, minor = (int(p) for p in tf.__version__.split(".")[:2])
        if (major, minor) < (2, 16):
            sys.exit(f"tfray needs TensorFlow 2.16 or newer, got {tf.__version__}.")
        compile_flags = tf.sysconfig.get_compile_flags()
        link_flags = tf.sysconfig.get_link_flags()
        for ext in self.extensions:
            ext.include_dirs.append(pybind11.get_include())
            ext.extra_compile_args += compile_flags + [
                "-O2",
                "-fvisibility=hidden",
                "-Wno-deprecated-declarations",
                f'-DTFRAY_BUILT_TF_VERSION="{tf.__version__}"',
                f"-DTFRAY_TF_MAJOR_VERSION={major}",
                f"-DTFRAY_TF_MINOR_VERSION={minor}",
            ]
            ext.extra_link_args += link_flags
        if os.environ.get("TFRAY_SANITIZE"):
            # UBSan's null and nonnull checks make GCC reject constant
            # expressions in TensorFlow's headers (absl's hash tables compare
            # function pointers in constexpr): those three are left out.
            sanitize = [
                "-fsanitize=address,undefined",
                "-fno-sanitize=null,nonnull-attribute,returns-nonnull-attribute",
            ]
            for ext in self.extensions:
                ext.extra_compile_args += sanitize + ["-g", "-fno-omit-frame-pointer"]
                ext.extra_link_args += sanitize
        # A library left in build/ by an earlier build is up to date by its
        # timestamps even when it was built against another TensorFlow.
        self.force = True
        super().build_extensions()
        self._tf_version, self._compile_flags = tf.__version__, compile_flags

    def run(self):
        super().run()
        # Read at import, before the library is loaded, to explain a
        # TensorFlow version mismatch instead of failing on a missing symbol.
        # Written after run(): with --inplace that is when the library lands.
        target_dir = os.path.dirname(self.get_ext_fullpath("tfray._native"))
        with open(os.path.join(target_dir, "_build_info.py"), "w") as f:
            f.write('"""Written by setup.py: what the native library was built against."""\n')
            f.write(f"TF_VERSION = {self._tf_version!r}\n")
            f.write(f"TF_COMPILE_FLAGS = {self._compile_flags!r}\n")


def _version():
    # Read, not imported: importing tfray needs the library this builds.
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tfray", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


setup(
    name="tfray",
    version=_version(),
    description="A zero-copy, GIL-free tf.data source over Ray's object store.",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfray", "tfray.*"]),
    python_requires=">=3.9",
    # The Ray range tested: 2.59 (constraints-oldest.txt) to 2.60 (requirements-dev.txt).
    install_requires=["numpy", "ray>=2.59,<3"],
    ext_modules=[
        Extension(
            "tfray._native",
            sources=[
                "csrc/channel.cc",
                "csrc/batch_buffer.cc",
                "csrc/dataset_op.cc",
                "csrc/inplace_ops.cc",
                "csrc/ops.cc",
                "csrc/store_map.cc",
                "csrc/window.cc",
                "csrc/bindings.cc",
            ],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildNative},
    zip_safe=False,
)
