"""The simulator's one exception (it was ``asyncconn.exceptions.SimulationError`` while the simulator
shipped inside the library)."""

from __future__ import annotations

__all__ = ["SimulationError"]


class SimulationError(Exception):
    """The offline engine (:class:`asyncconn_tools.sim.EngineSim`) was driven into a state vLLM would reject.

    Raised before vLLM sees the input: a reused or unknown request id, an empty prompt, a multimodal item
    outside its prompt, a config vLLM refuses, a step on a closed engine. Not an
    :class:`asyncconn.AsyncConnError`: the library never raises it.
    """
