"""The offline API's progress bar (frontend/progress.py): drawn on a terminal, with the
prompts done and the token speeds; silent elsewhere."""

from __future__ import annotations

import io

from pagedserve.frontend.outputs import CompletionOutput, RequestOutput
from pagedserve.frontend.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def output(num_prompt_tokens: int, num_output_tokens: int) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(num_output_tokens)), "length")
    return RequestOutput("r", None, list(range(num_prompt_tokens)), [completion], True)


def test_a_terminal_shows_the_prompts_done_and_the_speeds():
    terminal = Terminal()
    bar = ProgressBar(2, enabled=True, file=terminal)
    bar.finished(output(5, 3))
    bar.finished(output(7, 4))
    bar.close()
    text = terminal.getvalue()
    assert "Processed prompts" in text and "2/2" in text
    assert "est. speed input:" in text and "toks/s" in text


def test_nothing_is_drawn_off_a_terminal_or_when_off():
    for file, enabled in [(io.StringIO(), True), (Terminal(), False)]:
        bar = ProgressBar(1, enabled=enabled, file=file)
        bar.finished(output(5, 3))
        bar.close()
        assert file.getvalue() == ""
