"""asyncconn-tools: the development tooling around the asyncconn library, installed apart from it.

Everything the ``asyncconn`` command runs besides ``check`` and ``lookup-server``: ``bench`` (every
benchmark), ``demo`` (the demo's parts), ``chaos`` (the fault-injection harness) and ``cli`` (those three
commands, which :mod:`asyncconn.cli.main` imports by name when they run). ``sim`` is the offline engine
(vLLM's real scheduler with a simulated model runner); ``tiny_models`` builds small random-weight models
locally; ``engines`` runs vLLM's real engine in process; ``openai_server`` runs ``vllm serve`` as a
subprocess. The dependency runs one way: this package imports asyncconn (and vLLM, transformers, ...),
asyncconn never imports it (tests/test_layout.py checks both).
"""
