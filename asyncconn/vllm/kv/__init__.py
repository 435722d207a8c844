"""The KV connector vLLM loads (``AsyncConnKVConnector``, exported by :mod:`asyncconn.vllm`).

``connector`` is the facade vLLM instantiates: it builds exactly one ``scheduler`` side or ``worker`` side
and delegates to it. ``metadata`` holds what crosses from the scheduler to the workers each step (and the
stats that come back); ``keys`` maps vLLM's block hashes to store keys. The sides are plain classes,
testable without an engine.
"""
