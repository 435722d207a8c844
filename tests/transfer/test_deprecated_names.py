"""The old names of the transfer engines' API (docs/transfer.md, "Deprecated names") still work for one
release, and each use warns with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import warnings

import pytest
import torch

import asyncconn.transfer
import asyncconn.transfer.dest
from asyncconn.lookup import LookupClient, LookupServer
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, PinnedPool, SaveTracker, StreamLoader, TensorSpec
from tests.transfer.helpers import drain_loads, wait_until


@pytest.mark.parametrize("module", [asyncconn.transfer, asyncconn.transfer.dest])
def test_new_tensor_is_tensor_spec(module: object) -> None:
    with pytest.warns(DeprecationWarning, match="NewTensor is deprecated, use TensorSpec"):
        old = module.NewTensor  # type: ignore[attr-defined]
    assert old is TensorSpec
    with pytest.warns(DeprecationWarning, match="NewTensor"):
        from asyncconn.transfer import NewTensor  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        module.NoSuchName  # type: ignore[attr-defined]
    assert "NewTensor" not in asyncconn.transfer.__all__


def test_new_names_do_not_warn(runtime: Runtime, store: TensorStore) -> None:
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    tracker = SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loader.held(), loader.totals(), tracker.held(), tracker.totals(), tracker.poll()
            TensorSpec((2,), torch.float32)
    finally:
        loader.close()
        tracker.close()


def test_loader_counters_and_stats_warn_and_delegate(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("k", torch.arange(4.0))]))
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    try:
        loader.submit("k", TensorSpec((4,), torch.float32))
        assert drain_loads(loader, 1)["k"].ok
        with pytest.warns(DeprecationWarning, match=r"StreamLoader.counters\(\) is deprecated, use held\(\)"):
            assert loader.counters() == loader.held()
        with pytest.warns(DeprecationWarning, match=r"StreamLoader.stats\(\) is deprecated, use totals\(\)"):
            assert loader.stats() == loader.totals()
        assert loader.totals()["loaded"] == 1
    finally:
        loader.close()


def test_tracker_old_names_warn_and_delegate(runtime: Runtime, store: TensorStore) -> None:
    tracker = SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    try:
        assert tracker.submit("r1", "k", torch.arange(4.0))
        tracker.flush()
        done: set[str] = set()

        def finished() -> bool:
            with pytest.warns(DeprecationWarning, match=r"SaveTracker.poll_finished\(\) is deprecated"):
                done.update(tracker.poll_finished())
            return "r1" in done

        wait_until(finished, "the save")
        with pytest.warns(DeprecationWarning, match=r"SaveTracker.counters\(\) is deprecated, use held\(\)"):
            assert tracker.counters() == tracker.held()
        with pytest.warns(DeprecationWarning, match=r"SaveTracker.stats\(\) is deprecated, use totals\(\)"):
            assert tracker.stats() == tracker.totals()
        assert tracker.totals()["saved"] == 1
    finally:
        tracker.close()


@pytest.mark.parametrize("cls", [LookupClient, LookupServer])
def test_lookup_counters_is_held(cls: type) -> None:
    assert cls.counters.__doc__ == "Deprecated: use :meth:`held`."
