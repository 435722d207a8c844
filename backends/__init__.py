"""Built-in storage backends, one module each. They depend on the asyncconn core, never the reverse:
the core resolves them lazily by URL scheme (see :mod:`asyncconn.backend`)."""
