"""``mooncake://``: a Mooncake distributed store through its Python client (the ``mooncake`` extra).

``backend`` adapts the client's blocking calls to the async contract; ``layout`` is the framing of one
value as one Mooncake object.
"""

from .backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
