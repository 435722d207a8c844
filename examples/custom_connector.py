"""A vLLM EC connector written on asyncconn's building blocks, in about 130 lines.

``AsyncConnECConnector`` is the full-featured connector; this one shows the library use: a connector author
imports the lookup client, the stream loader and the save tracker directly and keeps vLLM's scheduler and
worker free of store I/O. It is deliberately simpler: no prefetch before admission (an item found by the
lookup is loaded when the scheduler installs it, waiting on the worker at most ``load_timeout``), and no
E->PD race handling. The cost of that simplicity, which ``AsyncConnECConnector`` does not pay: an item
that cannot be loaded at install (store down or value corrupt between the lookup and the install) is missing
from ``encoder_cache``, and vLLM fails the step ("Encoder cache miss"). ``AsyncConnECConnector`` only ever
plans an item as loaded once every worker has staged it. Use this one to learn the API, not in production.
Load it with::

    --ec-transfer-config '{"ec_connector": "LibraryECConnector",
                           "ec_connector_module_path": "examples.custom_connector",
                           "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"backend_url": "redis://127.0.0.1:6379/0"}}'
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from asyncconn.config import Settings
from asyncconn.lookup import EXISTS, LookupConfig, open_lookup_client, store_key
from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import SaveTracker, StreamLoader, TensorSpec


@dataclass
class LoadOrders:
    """Scheduler -> worker: the items to install this step (mm hash, embedding rows)."""

    items: list[tuple[str, int]] = field(default_factory=list)


class LibraryECConnector(ECConnectorBase):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self.settings = Settings.from_extra_config(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self.found: set[str] = set()  # scheduler: items the lookup found
        self.orders = LoadOrders()
        if role == ECConnectorRole.SCHEDULER:
            config = LookupConfig(backend_url=self.settings.backend_url, key_prefix=self.settings.key_prefix)
            self.lookup = open_lookup_client(config, EXISTS)  # answered on asyncconn's loop thread
            return
        runtime = get_runtime()
        self.store = runtime.run(TensorStore.open(self.settings.backend_url), self.settings.store_timeout)
        self.loader = StreamLoader(self.store) if self.is_consumer else None
        self.saver = SaveTracker(self.store) if self.is_producer else None

    # -- scheduler side: never waits on the store ---------------------------------------------------------
    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        hashes = [f.identifier for f in request.mm_features]
        answer = self.lookup.lookup(request.request_id, hashes)  # None: not answered yet, ask next step
        if answer is None:
            return False
        self.found.update(h for h, present in zip(hashes, answer, strict=True) if present)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self.found

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        feature = request.mm_features[index]
        if feature.identifier in self.found:
            self.orders.items.append((feature.identifier, feature.mm_position.get_num_embeds()))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        orders, self.orders = self.orders, LoadOrders()
        return orders

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self.lookup.discard(request.request_id)
        return False, None  # never True for EC: it would hold the request's KV blocks forever

    # -- worker side ------------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        orders = self._connector_metadata
        if self.loader is None or not isinstance(orders, LoadOrders):
            return
        wanted = {}
        for mm_hash, rows in orders.items:
            if mm_hash not in encoder_cache:
                key = store_key(self.settings.key_prefix, mm_hash)
                self.loader.submit(key, TensorSpec(max_nbytes=rows * self.settings.ec_max_row_bytes))
                wanted[key] = mm_hash
        deadline = time.monotonic() + self.settings.load_timeout
        while wanted and time.monotonic() < deadline:
            for result in self.loader.poll():
                mm_hash = wanted.pop(result.key)
                if result.ok and result.tensor is not None:
                    encoder_cache[mm_hash] = result.tensor
            time.sleep(0.0002)
        for key in wanted:  # failed or timed out: vLLM fails the step for the missing item (see above)
            self.loader.cancel(key)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self.saver is not None and mm_hash in encoder_cache:
            self.saver.submit(mm_hash, store_key(self.settings.key_prefix, mm_hash), encoder_cache[mm_hash])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.saver is not None:
            self.saver.flush()  # hand this step's saves to the loop; they finish in the background
            self.saver.poll()
        return None, None

    def shutdown(self) -> None:
        if self.role == ECConnectorRole.SCHEDULER:
            self.lookup.close()
            return
        for engine in (self.loader, self.saver):
            if engine is not None:
                engine.close()
        get_runtime().run(self.store.close(), self.settings.store_timeout)
