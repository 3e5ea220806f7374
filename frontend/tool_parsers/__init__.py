"""The readers of the models' own tool-call formats (``--tool-call-parser``), for
tool_choice "auto".

The shared layer (``tool_calls.py``) names no format; each is a module here whose reader
subclasses ``base.OutputReader``, and ``registry.py`` maps each parser name to it.
"""
