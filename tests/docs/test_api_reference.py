"""docs/api.md documents every public name, and only public names."""

import os
import re

from source_messages import REPO, read

import tfray


def test_the_reference_covers_tfray_all():
    """A name added to ``tfray.__all__`` without a reference entry fails here (Sphinx would not notice)."""
    text = read(os.path.join(REPO, "docs", "api.md"))
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: tfray\.(\w+)", text, re.MULTILINE))
    assert documented == set(tfray.__all__), (sorted(documented), sorted(tfray.__all__))
