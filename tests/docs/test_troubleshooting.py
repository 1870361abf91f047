"""docs/troubleshooting.md quotes every message tfray raises or logs, and none it no longer has."""

import os

import pytest
import source_messages as messages

PAGE = os.path.join(messages.REPO, "docs", "troubleshooting.md")


@pytest.fixture(scope="module")
def found():
    return messages.source_messages()


def test_every_message_in_the_source_is_read(found):
    """A message made from something the scan cannot read would escape the page: none may."""
    _, unreadable = found
    assert not unreadable, (
        "messages whose text the scan cannot read (write them as literals, f-strings, or a "
        "name bound to one in the same function or module):\n" + "\n".join(unreadable)
    )


def test_the_page_quotes_every_message(found):
    """A message tfray raises or logs that the page does not quote fails, naming where it is made."""
    quoted = messages.page_messages(PAGE)
    missing = [m for m in found[0] if not any(m.key in q for q in quoted)]
    assert not missing, (
        "docs/troubleshooting.md does not quote these messages; add a section for each, with the "
        "message as a line `> ``...``` (`…` for what is filled in), its cause and what to do:\n"
        + "\n".join(f"{m.where} ({m.kind}): {m.template}" for m in missing)
    )


def test_the_page_quotes_no_message_tfray_lost(found):
    """A quote on the page that no message in the source matches is stale (or mistyped)."""
    keys = [m.key for m in found[0]]
    stale = [q for q in messages.page_messages(PAGE) if not any(k in q for k in keys)]
    assert not stale, "docs/troubleshooting.md quotes messages tfray no longer has:\n" + "\n".join(stale)


def test_the_scan_finds_each_kind_of_message(found):
    """The scan itself: it reads raises, TF errors, log calls and native errors, or it checks nothing."""
    kinds = {m.kind for m in found[0]}
    assert {"raise", "BatchError", "EpochError", "log.warning", "log.info"} <= kinds, kinds
    assert any(k.startswith("absl::") for k in kinds), kinds
    assert len(found[0]) > 100
