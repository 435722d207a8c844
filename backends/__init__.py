"""Built-in storage backends, installed as ``asyncconn_backends`` (the repository keeps them in
``backends/``).

One module or package per store. They depend on the asyncconn core, never the reverse: the core resolves
them lazily by URL scheme (:mod:`asyncconn.backend`), so a store's client library loads only when a URL
names it.
"""
