"""Operator tooling around the library: everything the ``asyncconn`` command runs besides ``check`` and
``lookup-server``.

``tiny_models`` builds small random-weight models locally; ``engines`` runs vLLM's real engine in process;
``demo`` holds the demo's parts; ``bench`` every benchmark; ``chaos`` the fault-injection harness. Nothing
here is imported by the connectors vLLM loads: the dependency runs one way, tools -> simulator -> vLLM
adapters -> core (tests/test_layout.py checks it).
"""
