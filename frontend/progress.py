"""The offline API's progress bar (vLLM's ``use_tqdm``): prompts finished out of all, and
the speeds so far of prompt tokens in and output tokens out.

Drawn with tqdm on stderr, and only when stderr is a terminal (``disable=None``): a script
run by hand shows it, a log or a test's captured output gets nothing.
"""

from __future__ import annotations

import time
from typing import TextIO

from pagedserve.frontend.outputs import EmbeddingRequestOutput, RequestOutput


class ProgressBar:
    def __init__(self, total: int, enabled: bool, file: TextIO | None = None) -> None:
        """``file``: where to draw it (None: stderr); nothing unless it is a terminal."""
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True,
                disable=None, file=file,
            )  # fmt: skip
        self._started_s = time.monotonic()
        self._prompt_tokens = 0
        self._output_tokens = 0

    def finished(self, output: RequestOutput | EmbeddingRequestOutput) -> None:
        """One more prompt done."""
        if self._bar is None:
            return
        self._prompt_tokens += len(output.prompt_token_ids)
        if isinstance(output, RequestOutput):
            self._output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed_s = max(time.monotonic() - self._started_s, 1e-9)
        self._bar.set_postfix_str(
            f"est. speed input: {self._prompt_tokens / elapsed_s:.2f} toks/s, "
            f"output: {self._output_tokens / elapsed_s:.2f} toks/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
