"""One module per llama.cpp architecture (or family of near-identical ones): its names, and
the hooks of ``Architecture`` where it differs from the shared layer's defaults."""
