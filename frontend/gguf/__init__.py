"""The GGUF converter's parts (the entry point is ``pagedserve.frontend.gguf_convert``).

The shared layer names no architecture; each of llama.cpp's architectures is a module under
``architectures/`` that subclasses ``architecture.Architecture``, and ``registry.py`` maps
llama.cpp's name (``general.architecture``) to it.
"""
