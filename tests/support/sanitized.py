"""Runs pytest over tfray built with ASan and UBSan (``make test-sanitized``).

Usage: ``LD_PRELOAD="<libasan> <libubsan>" python tests/support/sanitized.py BUILD_LIB [pytest args]``.

Python is not built with ASan, so its runtimes are preloaded into this
process; they are dropped from the environment before Ray starts its own
processes, which must not load them (child processes, Ray's workers and the
tests' subprocesses, use the checkout's own build). The sanitized build comes
first on this process's sys.path, ahead of the checkout's tfray, and the run
stops unless that build is the tfray imported.
"""

import os
import sys

import pytest


def main():
    build, args = os.path.abspath(sys.argv[1]), sys.argv[2:]
    os.environ.pop("LD_PRELOAD", None)
    sys.path[:] = [build] + [p for p in sys.path if p not in ("", os.getcwd())]
    import tfray
    from tfray._internal.runtime import native

    native.load()  # An instrumented library loads only after the ASan runtime.
    if not tfray.__file__.startswith(build + os.sep):
        sys.exit(f"sanitized run: imported {tfray.__file__}, not the build in {build}")
    sys.exit(pytest.main(args))


if __name__ == "__main__":
    main()
