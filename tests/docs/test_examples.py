"""Every code block of README.md and docs/, and every docstring example, runs.

A page's Python blocks run in order in one namespace, as a reader pastes them
into one session, against the tests' local Ray (2 CPUs, a small object
store). A block that cannot run here says so on the line before its fence:
``<!-- not-run: the reason -->`` (a cluster, a GPU, a file tree). Blocks of
other languages must say so too; ``text`` blocks (output, diagrams) and MyST
directives are not code.

Docstring examples run against small stand-ins for the names a training
script has and the examples take as given (``model``, ``ray_ds``,
``make_batch``), each docstring in a namespace of its own. Where a docstring
example gives output, the output is compared.
"""

import contextlib
import doctest
import importlib
import io
import os
import pkgutil
import re

import pytest
from source_messages import REPO, read

PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")
)
RUN = {"python", "py"}
NOT_CODE = {"text"}
NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
FENCE = re.compile(r"^(```+|~~~+)\s*([^\s`]*)")

# Docstring examples that cannot run here, by qualified name, and why.
DOCSTRINGS_NOT_RUN = {
    "tfray.dataset.Dataset.from_tf_data": "needs a tree of JPEG files and a decode function",
}


def code_blocks(path):
    """(line, info, text, not-run reason or None) of each fenced block of a Markdown page."""
    lines = read(os.path.join(REPO, path)).split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start = match.group(1), match.group(2), i
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        blocks.append((start + 1, info, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return blocks


def test_every_page_is_found():
    """The pages the tests read are the site's pages and the README."""
    assert "README.md" in PAGES and os.path.join("docs", "sources.md") in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why_not(page):
    """No block of another language is left unmarked: it would never run, and nobody would know."""
    unmarked = [
        f"{page}:{line}: ```{info}"
        for line, info, _, reason in code_blocks(page)
        if reason is None and info not in RUN | NOT_CODE and not info.startswith("{")
    ]
    assert not unmarked, "blocks that neither run nor say why (<!-- not-run: reason -->):\n" + "\n".join(unmarked)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, ray_session):
    """Each Python block of the page runs, in order, in one namespace; an error names its line."""
    namespace = {"__name__": "__main__"}
    for line, info, text, reason in code_blocks(page):
        if info in RUN and reason is None:
            exec(compile(text, f"{page}:{line}", "exec"), namespace)
    namespace.clear()


def _standins():
    """Small stand-ins for the names docstring examples take as given."""
    import numpy as np
    import ray
    import ray.data
    import tensorflow as tf

    import tfray

    @ray.remote
    def make_batch(i):
        return {"image": np.random.rand(16, 8, 8, 3).astype(np.float32), "label": np.random.randint(0, 10, 16)}

    model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ray_ds = ray.data.range(1024).map_batches(
        lambda b: {"features": np.repeat(b["id"][:, None], 8, axis=1).astype(np.float32), "label": b["id"] % 2},
        batch_size=256,
    )
    return {"np": np, "tf": tf, "ray": ray, "tfray": tfray, "make_batch": make_batch, "model": model, "ray_ds": ray_ds}


def _docstring_examples():
    import tfray

    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for info in pkgutil.walk_packages(tfray.__path__, "tfray."):
        module = importlib.import_module(info.name)
        found += [t for t in finder.find(module) if t.examples]
    return sorted(found, key=lambda t: t.name)


def test_docstring_examples_are_found():
    """The scan finds the public constructors' examples, or it checks nothing."""
    names = {t.name for t in _docstring_examples()}
    assert {"tfray.dataset.Dataset", "tfray.dataset.Dataset.from_generators"} <= names, names
    assert set(DOCSTRINGS_NOT_RUN) <= names, "a docstring marked not-run has no example any more"


@pytest.mark.timeout(300)
def test_docstring_examples_run(ray_session):
    """Each docstring example runs; one that gives output gives that output."""
    ran = []
    for test in _docstring_examples():
        if test.name in DOCSTRINGS_NOT_RUN:
            continue
        namespace = {"__name__": "__main__", **_standins()}
        for example in test.examples:
            where = f"{test.filename}:{(test.lineno or 0) + example.lineno + 1} ({test.name})"
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(example.source, where, "single" if example.want else "exec"), namespace)
            if example.want:
                assert out.getvalue().strip() == example.want.strip(), where
        namespace.clear()
        ran.append(test.name)
    assert ran
