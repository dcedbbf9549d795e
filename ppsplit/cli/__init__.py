"""The ``ppsplit`` command line (``ppsplit.cli.commands``)."""
from ppsplit.cli.commands import main

__all__ = ["main"]
