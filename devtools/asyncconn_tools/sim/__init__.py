"""The offline engine: vLLM's real V1 ``Scheduler`` driving a simulated model runner.

What it is still for, now that vLLM's real engine is the proof (docs/simulator.md): fast unit tests of
the connectors' scheduler-side rules (admission, chunked prefill, preemption, delayed frees) in a second
instead of an engine build, and the chaos harness, which needs many engines stepping under injected
faults. ``engine`` builds and steps it; ``runner`` is the simulated model runner (it calls the worker-side
connector hooks in vLLM's order and writes predictable embeddings and KV); ``config`` builds vLLM's
config objects for a weightless model. Importing this package does not import vLLM.
"""

from asyncconn_tools.sim.engine import (
    ConnectorSpec,
    EngineSim,
    MMItem,
    SimShape,
    StepRecord,
    embedding_for,
    kv_values,
    make_model_dir,
)
from asyncconn_tools.sim.errors import SimulationError

__all__ = [
    "ConnectorSpec",
    "EngineSim",
    "MMItem",
    "SimShape",
    "SimulationError",
    "StepRecord",
    "embedding_for",
    "kv_values",
    "make_model_dir",
]
