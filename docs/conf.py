"""Sphinx configuration: the user guide (MyST Markdown) and the API reference (autodoc)."""

import os
import sys

# The source tree, for `import tfray` (an in-place build, as `make docs` makes).
sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfray  # noqa: E402

project = "tfray"
version = release = tfray.__version__
author = "tfray contributors"
copyright = "tfray contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# Names of other libraries: no inventory is fetched (the build needs no
# network), so references to them stay unresolved on purpose.
nitpick_ignore_regex = [
    (r"py:.*", r"(tf|tensorflow|ray|np|numpy|typing)\..*"),
    (r"py:class", r"(int|float|bool|str|None|Optional\[str\])"),
]

html_theme = "alabaster"
html_title = f"tfray {release}"
html_static_path = []
