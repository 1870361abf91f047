"""Builds and runs the plain C++ unit test of the native channel.

Guards csrc/channel.{h,cc} on its own, without TensorFlow, Ray or Python in
the way: FIFO order of batches and errors, Close/Cancel semantics, bounded
capacity and backpressure, ReleaseToken accounting, channel stats and the
SourceRegistry; and csrc/store_map.{h,cc}, which tells the object store's
memory from any other by address. Each is compiled with ASan and UBSan so that memory errors and
undefined behaviour in the channel fail the test rather than a later,
unrelated one.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SOURCES = [
    _ROOT / "csrc" / "channel.cc",
    _ROOT / "tests" / "native" / "channel_test.cc",
]
_CXXFLAGS = [
    "-std=c++17",
    "-O1",
    "-g",
    "-pthread",
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
]


def build_and_run(tmp_path, sources, name):
    """Builds ``sources`` under ASan/UBSan and runs the program; returns its last line."""
    # No compiler is a failure, not a skip: tfray itself cannot be built
    # without one, and a skip would hide that the channel went untested.
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    assert cxx is not None, "no C++ compiler (g++, or $CXX) found to build tests/native/channel_test.cc"

    binary = tmp_path / name
    build = subprocess.run(
        [cxx, *_CXXFLAGS, "-I", str(_ROOT / "csrc"),
         *map(str, sources), "-o", str(binary)],
        capture_output=True, text=True, timeout=240,
    )
    assert build.returncode == 0, f"build failed:\n{build.stderr}"

    env = dict(os.environ)
    # UBSan only prints and carries on by default; a finding must fail here.
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    run = subprocess.run(
        [str(binary)], capture_output=True, text=True, timeout=120, env=env,
    )
    output = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, output
    return (run.stdout.strip().splitlines() or [""])[-1], output


@pytest.mark.timeout(300)
def test_channel_native(tmp_path):
    """The native channel test program builds and all its checks pass."""
    last_line, output = build_and_run(tmp_path, _SOURCES, "channel_test")
    assert last_line.endswith(" passed, 0 failed"), output


@pytest.mark.timeout(300)
def test_store_map_native(tmp_path):
    """Store files are told apart by address, by the kernel's query and by the maps file alike."""
    sources = [_ROOT / "csrc" / "store_map.cc", _ROOT / "tests" / "native" / "store_map_test.cc"]
    last_line, output = build_and_run(tmp_path, sources, "store_map_test")
    assert last_line.endswith("passed"), output
