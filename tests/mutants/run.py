"""Runs each deliberate breakage of tfray against the tests that claim to catch it.

Usage: ``python tests/mutants/run.py [NAME ...] [--keep] [--scratch DIR]``
(``make test-mutants``). NAME is a patch in this directory without
``.patch``; none means all of them.

Each ``NAME.patch`` is a unified diff against the tracked tree, applied with
``git apply``, after a header of lines such as::

    # Mutant: what the patch does.
    # Breaks: the claim it breaks (and its item of the issue that asked).
    # Must fail: tests/test_x.py::test_y        (one line per test node id)
    # Must fail command: python examples/x.py   (optional, run from the tree)
    # Hide from PATH: g++                       (optional, for these runs)

A header with no diff after it changes no file: its breakage is the
environment (``Hide from PATH``).

For the unmutated tree once, then for each mutant, the runner copies the
tracked files (as they are in the work tree) into a scratch directory,
applies the patch, and builds tfray out of place there (``setup.py build``;
a patch that leaves ``csrc/`` and ``setup.py`` alone reuses the unmutated
native library and rebuilds only the Python files). The build then holds
the whole package, so the copy's source ``tfray/`` is removed, and the
tests run from the copy with the build first on ``PYTHONPATH``, which Ray's
workers and the tests' subprocesses inherit; ``build_check.py`` stops the
run unless the test process and a Ray worker import the build.

A mutant is KILLED when every test it names fails (and every command exits
non-zero), SURVIVED otherwise. The runner exits non-zero when a mutant
survived, a named test did not run, a patch no longer applies, or a named
test fails on the unmutated tree.
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "build_check", "-q", "-rN"]
# One run of a mutant's tests; a test's own timeout (pytest.ini) ends it sooner.
RUN_TIMEOUT_S = 1200
COMMAND_TIMEOUT_S = 600
NATIVE_FILES = ("csrc/", "setup.py")


class Mutant:
    def __init__(self, path):
        self.name = os.path.basename(path)[: -len(".patch")]
        self.path = path
        self.fields = {}
        with open(path) as f:
            lines = f.read().splitlines()
        body = 0
        for body, line in enumerate(lines):  # noqa: B007
            match = re.match(r"# ([A-Za-z ]+): (.*)", line)
            if not match:
                break
            self.fields.setdefault(match.group(1).lower(), []).append(match.group(2).strip())
        else:
            body = len(lines)
        self.has_diff = any(line.startswith("diff --git") for line in lines[body:])
        self.files = re.findall(r"^diff --git a/(\S+)", "\n".join(lines), re.M)
        self.tests = self.fields.get("must fail", [])
        self.commands = self.fields.get("must fail command", [])
        self.hidden = self.fields.get("hide from path", [])
        self.breaks = "; ".join(self.fields.get("breaks", []))
        if not self.tests and not self.commands:
            raise SystemExit(f"{path}: names no test (`# Must fail: ...`) and no command")

    @property
    def native(self):
        return any(f.startswith(NATIVE_FILES) for f in self.files)


def log(message):
    print(message, flush=True)


def copy_tree(dest):
    """The tracked files, as they are in the work tree, copied into ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        source = os.path.join(ROOT, name)
        if not os.path.isfile(source):
            continue  # Deleted in the work tree.
        target = os.path.join(dest, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)


def git_env(tree):
    # Never let git find a repository above the scratch copy.
    return dict(os.environ, GIT_CEILING_DIRECTORIES=os.path.dirname(tree))


def apply(mutant, tree):
    """Applies the patch; returns an error message when it no longer applies."""
    if not mutant.has_diff:
        return None
    check = subprocess.run(
        ["git", "apply", "--check", mutant.path], cwd=tree, env=git_env(tree), capture_output=True, text=True
    )
    if check.returncode:
        return f"the patch no longer applies to this tree: {check.stderr.strip()}"
    subprocess.run(["git", "apply", mutant.path], cwd=tree, env=git_env(tree), check=True)
    return None


def build(tree, jobs, base_build=None):
    """Builds tfray in ``tree``/build; returns the directory that holds the package.

    With ``base_build``, the unmutated build's native library is reused and
    only the Python files are built from ``tree``.
    """
    build_base = os.path.join(tree, "build")
    if base_build is None:
        command = [sys.executable, "setup.py", "-q", "build", "--build-base", build_base, "-j", str(jobs)]
    else:
        shutil.copytree(os.path.dirname(base_build), build_base)
        lib = os.path.join(build_base, os.path.basename(base_build))
        command = [sys.executable, "setup.py", "-q", "build_py", "--force", "--build-lib", lib]
    started = time.monotonic()
    run = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"build failed in {tree}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    (lib,) = glob.glob(os.path.join(build_base, "lib.*"))
    if not glob.glob(os.path.join(lib, "tfray", "_native*.so")):
        raise RuntimeError(f"build in {tree}: no native library in {lib}")
    # The build holds the whole package: nothing may import the source copy.
    shutil.rmtree(os.path.join(tree, "tfray"))
    log(f"  built in {time.monotonic() - started:.0f} s ({'Python files only' if base_build else 'native library and Python'})")
    return lib


def shadow_path(tree, hidden):
    """A directory of links to every program on PATH but ``hidden``; PATH for the run."""
    shadow = os.path.join(tree, "path-without-" + "-".join(hidden))
    os.makedirs(shadow, exist_ok=True)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            target = os.path.join(shadow, name)
            program = os.path.join(directory, name)
            if name in hidden or os.path.lexists(target) or not os.access(program, os.X_OK):
                continue
            os.symlink(program, target)
    return shadow


def environment(tree, lib, hidden=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([lib, os.path.join(tree, "tests", "mutants")])
    env["TFRAY_MUTANT_BUILD"] = lib
    env["TFRAY_MUTANT_REPORT"] = os.path.join(tree, "report.jsonl")
    if hidden:
        env["PATH"] = shadow_path(tree, hidden)
        for name in ("CXX", "CC"):
            env.pop(name, None)
    return env


def check_imports(tree, env):
    """Fails unless the driver and a Ray worker import tfray from the build."""
    run = subprocess.run(
        [sys.executable, os.path.join(tree, "tests", "mutants", "build_check.py")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        # Two imports of TensorFlow: one took over 3 minutes in a Ray worker
        # while CI runs installed TensorFlow beside this run.
        timeout=900,
    )
    if run.returncode:
        raise RuntimeError(f"import check failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")


def read_report(path):
    started, results = [], {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record["event"] == "start":
                    started.append(record["nodeid"])
                    continue
                previous = results.get(record["nodeid"])
                if record["outcome"] != "passed" or previous is None:
                    if previous is None or previous[0] == "passed":
                        results[record["nodeid"]] = (record["outcome"], record["message"])
    return started, results


def run_tests(tree, env, tests):
    """``{node id: (outcome, message)}``; outcome is passed, failed, skipped or not run."""
    results = {}
    pending = list(tests)
    while pending:
        report = env["TFRAY_MUTANT_REPORT"]
        if os.path.exists(report):
            os.remove(report)
        try:
            run = subprocess.run(
                PYTEST + pending, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
            output, ended = run.stdout + run.stderr, f"exit code {run.returncode}"
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            ended = f"killed after {RUN_TIMEOUT_S} s"
        started, reported = read_report(report)
        progressed = False
        for nodeid in pending:
            if nodeid in reported:
                results[nodeid] = reported[nodeid]
                progressed = True
        for nodeid in started:
            if nodeid in pending and nodeid not in reported:
                # It started and never reported: the process ended inside it.
                why = "Timeout" if "+++ Timeout +++" in output else ended
                results[nodeid] = ("failed", f"the test process ended during the test ({why})")
                progressed = True
        pending = [t for t in pending if t not in results]
        if pending and not progressed:
            tail = "\n".join(output.strip().splitlines()[-15:])
            for nodeid in pending:
                results[nodeid] = ("not run", f"pytest ({ended}) did not run it:\n{tail}")
            pending = []
    return results


def brief(message, lines=3, width=240):
    """The first lines of a failure message, each cut to ``width``."""
    return "\n           ".join(line[:width] for line in message.strip().splitlines()[:lines])


def run_commands(tree, env, commands):
    """``{command: (outcome, message)}``; outcome is passed or failed (exit status)."""
    results = {}
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "python":
            argv[0] = sys.executable
        try:
            run = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            lines = (run.stdout + run.stderr).strip().splitlines()
            # The examples say FAILED on the line that tells why; else the last line.
            said = [line for line in lines if "FAILED" in line] or lines[-1:]
            status = "failed" if run.returncode else "passed"
            results[command] = (status, f"exit code {run.returncode}: {said[-1] if said else ''}")
        except subprocess.TimeoutExpired:
            results[command] = ("failed", f"killed after {COMMAND_TIMEOUT_S} s")
    return results


def prepare(scratch, name, jobs, mutant=None, base_build=None):
    tree = os.path.join(scratch, name)
    os.makedirs(tree)
    copy_tree(tree)
    if mutant is not None:
        error = apply(mutant, tree)
        if error:
            return tree, None, error
    reuse = base_build if mutant is not None and not mutant.native else None
    return tree, build(tree, jobs, reuse), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--scratch", help="where to build the copies (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compiler jobs per build")
    args = parser.parse_args()

    paths = sorted(glob.glob(os.path.join(HERE, "*.patch")))
    mutants = [Mutant(p) for p in paths]
    if args.names:
        unknown = set(args.names) - {m.name for m in mutants}
        if unknown:
            raise SystemExit(f"no such mutant: {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m.name in args.names]
    scratch = args.scratch or tempfile.mkdtemp(prefix="tfray-mutants-")
    os.makedirs(scratch, exist_ok=True)
    started = time.monotonic()
    problems = []
    try:
        log(f"unmutated tree (scratch {scratch})")
        tree, base_lib, _ = prepare(scratch, "unmutated", args.jobs)
        env = environment(tree, base_lib)
        check_imports(tree, env)
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        commands = list(dict.fromkeys(c for m in mutants for c in m.commands))
        baseline = run_tests(tree, env, tests)
        baseline.update(run_commands(tree, env, commands))
        for what, (outcome, message) in baseline.items():
            log(f"  {outcome.upper():8} {what}" + (f"\n           {brief(message, 15)}" if outcome != "passed" else ""))
            if outcome != "passed":
                problems.append(f"unmutated: {what} {outcome}")

        summary = []
        for mutant in mutants:
            log(f"\n{mutant.name}: {mutant.breaks}")
            tree, lib, error = prepare(scratch, mutant.name, args.jobs, mutant, base_lib)
            if error:
                log(f"  NOT APPLIED: {error}")
                problems.append(f"{mutant.name}: patch does not apply")
                summary.append((mutant.name, "NOT APPLIED"))
                continue
            env = environment(tree, lib, mutant.hidden)
            check_imports(tree, dict(environment(tree, lib)))
            results = run_tests(tree, env, mutant.tests)
            results.update(run_commands(tree, env, mutant.commands))
            survivors = []
            for what, (outcome, message) in results.items():
                log(f"  {outcome.upper():8} {what}\n           {brief(message)}")
                if outcome != "failed":
                    survivors.append(what)
                if outcome == "not run":
                    problems.append(f"{mutant.name}: {what} did not run")
            verdict = "KILLED" if not survivors else "SURVIVED"
            log(f"  {verdict}" + (f" (passed or not failed: {', '.join(survivors)})" if survivors else ""))
            if survivors:
                problems.append(f"{mutant.name}: survived")
            summary.append((mutant.name, verdict))
            if not args.keep:
                shutil.rmtree(tree, ignore_errors=True)
    finally:
        if not args.keep and not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    log(f"\n{len(summary)} mutants in {time.monotonic() - started:.0f} s")
    for name, verdict in summary:
        log(f"  {verdict:12} {name}")
    if problems:
        log("problems:\n  " + "\n  ".join(problems))
        sys.exit(1)


if __name__ == "__main__":
    main()
