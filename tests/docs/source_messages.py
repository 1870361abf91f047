"""Every message tfray raises or logs, read from its source: Python in tfray/, C++ in csrc/.

A message is found where it is made:

- Python: ``raise SomeError(msg)``; ``BatchError(code, msg)`` and
  ``EpochError(code, msg)`` (the TF errors ``next()`` raises);
  ``channel.push_error(code, msg)``; ``logger.info/warning/error/exception``
  and ``logging.*`` of the same levels; ``warnings.warn(msg)``.
- C++: ``absl::*Error(...)``, ``errors::*(...)``, ``throw py::*(...)`` and
  ``PyErr_SetString(...)``.

Each message is read as its literal text, split at what is filled in at run
time (f-string fields, ``%s`` of a log call, ``{}`` of ``str.format``, a
variable between literals); a name bound to a literal in the same function or
module is followed. A message made by an exception class from something that
cannot be read this way is reported as unreadable, so no message escapes the
page unseen.
"""

import ast
import dataclasses
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOG_LEVELS = {"info", "warning", "error", "exception", "critical"}
# Constructors whose second argument is a message: tfray's TF-error carriers.
CODED = {"BatchError", "EpochError", "push_error"}
# What stands for a part filled in at run time, on the page and here.
GAP = "…"
# A literal run at least this long names its message; shorter ones (a
# message that is mostly a wrapped exception) are matched whole.
STABLE_CHARS = 16


@dataclasses.dataclass(frozen=True)
class Message:
    """One message in the source: where, how it is raised or logged, and its literal runs."""

    where: str
    kind: str
    chunks: tuple

    @property
    def key(self):
        """The stable fragment the page must quote: the longest literal run, or the whole template."""
        chunks = [normalize(c) for c in self.chunks]
        longest = max(chunks, key=len)
        if len(longest) >= STABLE_CHARS:
            return longest
        return normalize(GAP.join(self.chunks))

    @property
    def template(self):
        return normalize(GAP.join(self.chunks))


def normalize(text):
    return " ".join(text.split())


_PERCENT = re.compile(r"%(\([^)]*\))?[-+ #0]*\d*(\.\d+)?[sdrifxg]")
_BRACES = re.compile(r"\{[^{}]*\}")


def _split(text, pattern):
    return pattern.split(text) if pattern is _BRACES else [p for p in _PERCENT.sub("\0", text).split("\0")]


def _join(a, b):
    return a[:-1] + [a[-1] + b[0]] + b[1:]


class _Reader:
    """The literal runs of a message expression, following names bound to literals."""

    def __init__(self, module_names):
        self.module_names = module_names
        self.local_names = {}

    def chunks(self, node, *, percent=False):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return _split(node.value, _PERCENT) if percent else [node.value]
        if isinstance(node, ast.JoinedStr):
            out = [""]
            for value in node.values:
                if isinstance(value, ast.Constant):
                    out[-1] += value.value
                else:
                    out.append("")
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _join(self.chunks(node.left) or ["", ""], self.chunks(node.right) or ["", ""])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            left = self.chunks(node.left)
            return None if left is None else [c for part in left for c in _split(part, _PERCENT)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            base = self.chunks(node.func.value)
            return None if base is None else [c for part in base for c in _split(part, _BRACES)]
        if isinstance(node, ast.Name):
            bound = self.local_names.get(node.id, self.module_names.get(node.id))
            return None if bound is None else self.chunks(bound, percent=percent)
        return None


def _literal_bindings(body):
    """Names assigned once in ``body``'s statements (not nested functions), to their values."""
    found = {}
    for node in body:
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                found[sub.targets[0].id] = sub.value
    return found


def _loggers(tree):
    names = {"logging"}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "logging.getLogger"
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _callee(call):
    return ast.unparse(call.func)


def _looks_like_an_exception(call):
    name = _callee(call).split(".")[-1]
    return name.endswith(("Error", "Exception", "Warning")) or _callee(call).startswith("type(")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _python_file(path):
    """The messages of one Python file, and the unreadable ones."""
    tree = ast.parse(read(path))
    rel = os.path.relpath(path, REPO)
    loggers = _loggers(tree)
    reader = _Reader(_literal_bindings(tree.body))
    found, unreadable = [], []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, _literal_bindings(child.body))
                continue
            reader.local_names = local
            kind, arg, percent = _classify(child, loggers)
            if kind is not None:
                chunks = reader.chunks(arg, percent=percent) if arg is not None else None
                where = f"{rel}:{child.lineno}"
                if _passed_on(arg):
                    pass  # An error made elsewhere, passed on: its message is where it is made.
                elif chunks is None or not "".join(chunks).strip():
                    if kind != "raise" or _looks_like_an_exception(child.exc):
                        unreadable.append(f"{where}: {ast.unparse(child)[:120]}")
                else:
                    found.append(Message(where, kind, tuple(chunks)))
            visit(child, local)

    visit(tree, {})
    return found, unreadable


def _passed_on(arg):
    """Whether a message expression is another error's message (``e.message``), passed on as it is."""
    return isinstance(arg, ast.Attribute) and arg.attr == "message"


def _classify(node, loggers):
    """(kind, message expression, whether %-formatted) of a node that makes a message, else Nones."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        call = node.exc
        if _callee(call).split(".")[-1] in CODED:
            return None, None, False  # The call itself is visited as CODED.
        if not _looks_like_an_exception(call):
            return None, None, False  # A helper that returns an error: its message is where it is made.
        return "raise", (call.args[0] if call.args else None), False
    if isinstance(node, ast.Call):
        callee = _callee(node)
        head, _, attr = callee.rpartition(".")
        if attr in LOG_LEVELS and head in loggers:
            return f"log.{attr}", (node.args[0] if node.args else None), True
        if callee == "warnings.warn":
            return "warn", node.args[0], False
        if callee.split(".")[-1] in CODED and len(node.args) >= 2:
            return callee.split(".")[-1], node.args[1], False
    return None, None, False


_NATIVE_CALL = re.compile(r"\b(absl::\w+Error|errors::\w+|throw\s+py::\w+|PyErr_SetString)\s*\(")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _native_file(path):
    text = read(path)
    rel = os.path.relpath(path, REPO)
    found = []
    for match in _NATIVE_CALL.finditer(text):
        depth, i = 1, match.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[match.end() : i - 1]
        chunks, last_end = [""], None
        for lit in _STRING.finditer(args):
            if last_end is not None and args[last_end : lit.start()].strip():
                chunks.append("")
            chunks[-1] += bytes(lit.group(1), "utf-8").decode("unicode_escape")
            last_end = lit.end()
        if last_end is not None and args[last_end:].strip(" \n)"):
            chunks.append("")
        if "".join(chunks).strip():
            line = text.count("\n", 0, match.start()) + 1
            found.append(Message(f"{rel}:{line}", match.group(1), tuple(chunks)))
    return found


def _files(top, suffixes):
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(suffixes):
                yield os.path.join(root, name)


def source_messages():
    """(messages, unreadable) over tfray/ and csrc/."""
    messages, unreadable = [], []
    for path in _files("tfray", (".py",)):
        found, bad = _python_file(path)
        messages += found
        unreadable += bad
    for path in _files("csrc", (".cc", ".h")):
        messages += _native_file(path)
    return messages, unreadable


# A message on the page: a line ``> ``text`` `` in a section of its own.
_PAGE_MESSAGE = re.compile(r"^> ``(.+)``\s*$")


def page_messages(path):
    """The messages the troubleshooting page quotes, whitespace normalized."""
    out = []
    for line in read(path).split("\n"):
        match = _PAGE_MESSAGE.match(line)
        if match:
            out.append(normalize(match.group(1)))
    return out
