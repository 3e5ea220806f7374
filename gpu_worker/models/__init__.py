"""The models this engine serves: ``registry.py`` names each HF architecture's torch-free
description (``architectures/``) and the torch model that implements it (the modules here).
Torch-free itself, so that the frontend may read a model's description without torch."""
