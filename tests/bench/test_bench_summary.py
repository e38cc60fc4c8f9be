"""The committed headline page is the committed results' (re-running a benchmark without
`python -m bench.summary` left it quoting figures three rounds old)."""

from __future__ import annotations

from bench.common import RESULTS
from bench.summary import summary_text


def test_the_summary_page_is_current_with_the_committed_results() -> None:
    assert (RESULTS / "SUMMARY.md").read_text() == summary_text(), "run: python -m bench.summary"
