"""The ``asyncconn`` command."""

from asyncconn.cli.main import main

__all__ = ["main"]
