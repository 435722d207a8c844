"""Chaos runs: both connectors on vLLM's real scheduler while real servers are killed, frozen and corrupted.

``asyncconn chaos`` (:mod:`asyncconn_tools.cli.chaos`) and ``tests/tools/test_chaos.py`` drive
:func:`run_chaos`; docs/reliability.md has the figures.
"""

from asyncconn_tools.chaos.harness import ChaosConfig, ChaosReport, run_chaos

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos"]
