"""What the frontend's modules import: not torch.

torch takes seconds to import. The command line answers ``--help`` and refuses bad flags
before anything loads, and a multi-process ``LLM`` starts its workers (which import torch
themselves) before its own tokenizer pulls torch in through transformers, so that the two
overlap; an import of torch at the top of a frontend module would undo both.
"""

from __future__ import annotations

import subprocess
import sys

FRONTEND_MODULES = (
    "pagedserve.frontend.cli",
    "pagedserve.frontend.llm",
    "pagedserve.frontend.server",
    "pagedserve.frontend.engine_client",
)


def test_the_frontend_modules_do_not_import_torch():
    program = (
        "import importlib, sys\n"
        f"for name in {FRONTEND_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "    heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "    if heavy:\n"
        "        sys.exit(f'{name} imports {heavy}')\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert finished.returncode == 0, finished.stderr
