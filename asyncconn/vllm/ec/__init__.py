"""The EC connector vLLM loads (``AsyncConnECConnector``, exported by :mod:`asyncconn.vllm`).

``connector`` is the facade vLLM instantiates: it builds exactly one ``scheduler`` side or ``worker`` side
and delegates to it. ``metadata`` holds what crosses from the scheduler to the workers each step and the
workers' reports back. The sides are plain classes, testable without an engine.
"""
