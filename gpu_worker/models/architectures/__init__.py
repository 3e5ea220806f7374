"""One torch-free module per architecture (or family of near-identical ones), each a
subclass of ``models.architecture.Architecture``, registered in ``models/registry.py``."""
