"""The mutant runner's helpers inside the processes it starts (``run.py``).

As a pytest plugin (``-p build_check``): stops the run unless the tfray
imported is the build in ``$TFRAY_MUTANT_BUILD``, and appends each test's
start and outcome to ``$TFRAY_MUTANT_REPORT`` (JSON lines) as they happen,
so a run that a timeout ends still says which test it was in.

As a script: checks that this process and a Ray worker it starts both
import tfray, native library included, from that build, and exits non-zero
otherwise.
"""

import json
import os
import sys


def _inside_build(path):
    build = os.path.realpath(os.environ["TFRAY_MUTANT_BUILD"])
    return os.path.realpath(path).startswith(build + os.sep)


def _where_tfray_is():
    """``(package file, native library file)`` of the tfray this process imports."""
    import importlib.util

    import tfray

    return tfray.__file__, importlib.util.find_spec("tfray._native").origin


def _check(where, who):
    wrong = [path for path in where if not _inside_build(path)]
    if wrong:
        sys.exit(
            f"mutant run: {who} imports tfray from {', '.join(wrong)}, "
            f"expected the build in {os.environ['TFRAY_MUTANT_BUILD']}"
        )


def _record(**fields):
    with open(os.environ["TFRAY_MUTANT_REPORT"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def pytest_configure(config):
    _check(_where_tfray_is(), "the test process")


def pytest_runtest_logstart(nodeid, location):
    _record(nodeid=nodeid, event="start")


def pytest_runtest_logreport(report):
    if report.passed and report.when != "call":
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = report.longrepr[2]
    _record(nodeid=report.nodeid, event=report.when, outcome=report.outcome, message=message)


def main():
    """Checks this process's tfray and a Ray worker's."""
    import ray

    _check(_where_tfray_is(), "the driver")
    ray.init(address="local", num_cpus=1, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
    try:
        _check(ray.get(ray.remote(_where_tfray_is).remote()), "a Ray worker")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
