"""The native library is built against, and checked against, the TF that runs."""

import os
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf
from conftest import SOURCE_TREE, installed_as_a_copy

import tfray
from tfray import _build_info
from tfray._internal.runtime import native

pytestmark = pytest.mark.timeout(120)


def test_built_with_the_running_tensorflows_flags():
    """setup.py took its flags from tf.sysconfig of the TF that runs here."""
    assert _build_info.TF_VERSION == tf.__version__
    assert native.load().lib.built_tf_version() == tf.__version__
    assert _build_info.TF_COMPILE_FLAGS == tf.sysconfig.get_compile_flags()


def test_tests_import_the_installed_copy_when_installed_as_one():
    """After `pip install .` or a wheel, tfray comes from site-packages, not the source tree."""
    imported_from_source = os.path.dirname(os.path.abspath(tfray.__file__)) == os.path.join(
        SOURCE_TREE, "tfray"
    )
    assert imported_from_source != installed_as_a_copy()


def test_version_mismatch_message_says_expected_got_and_how_to_rebuild():
    """The mismatch error names both versions and the rebuild command."""
    with pytest.raises(ImportError) as info:
        native.check_tf_version("2.20.0", "2.21.0")
    message = str(info.value)
    assert "expected 2.20.0, got 2.21.0" in message
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in message


def test_import_fails_cleanly_for_a_library_built_for_another_tf(tmp_path):
    """`import tfray` with a library from another TF raises that ImportError."""
    package = os.path.dirname(tfray.__file__)
    copy = tmp_path / "tfray"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "_build_info.py").write_text("TF_VERSION = '2.0.0'\nTF_COMPILE_FLAGS = []\n")
    code = "import tfray"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode != 0
    assert "ImportError: tfray's native library was built for TensorFlow 2.0.0" in proc.stderr
    assert str(tmp_path) in proc.stderr  # The copy was imported, not the checkout.
