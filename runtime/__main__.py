"""``python -m runtime`` is the ``runtime`` command."""

from .cli import entry

entry()
