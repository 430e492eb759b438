"""The ``lit-offpolicy`` command (``command.py``), its one-line parser errors and its quiet console."""

from lit_offpolicy.cli.command import OffPolicyCLI, main

__all__ = ["OffPolicyCLI", "main"]
