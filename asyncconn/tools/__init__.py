"""Operator tooling around the library: tiny local models, real vLLM engines, the demo's engine parts.

Nothing here is imported by the connectors vLLM loads; the dependency runs the other way
(``tools -> vllm adapters -> core``).
"""
