"""``redis://``, ``rediss://``, ``unix://`` and ``redis+cluster://``.

``backend`` is the store on redis-py's asyncio client; ``reader`` and ``writer`` are the raw-socket fast
path for chunked values (replies received straight into caller buffers, writes from tensor memoryviews);
``layout`` is the one-key-per-value format both paths share; ``cluster`` reuses all of it per slot.
"""

from .backend import RedisBackend
from .cluster import RedisClusterBackend

__all__ = ["RedisBackend", "RedisClusterBackend"]
