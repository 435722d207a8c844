"""The engine simulator against vLLM's real V1 scheduler, with no connector, vLLM's example connectors, and
recording connectors that check the worker-side call order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from asyncconn_tools.sim import SimulationError
from asyncconn_tools.sim.engine import ConnectorSpec, MMItem, SimShape, embedding_for
from asyncconn_tools.sim.runner import GatheredRows, ScheduledRows, StepPlan, WorkerStepResult

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

HIDDEN = SimShape().hidden_size
KV_EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"


# -- recording connectors: loaded by vLLM's factories through this module's path ------------------------


class SimRecordingKV(KVConnectorBase_V1):
    """Holds every finished request's blocks (``request_finished`` -> True) until the workers report it
    sent; worker ``rank`` reports ``rank`` steps late, so the merge must wait for the slowest."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.calls: list[str] = []
        self.rank = 0
        self.registered: dict[str, torch.Tensor] = {}
        self._pending: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return True, None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.calls.append("register_kv_caches")
        self.registered = kv_caches

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.calls.append("handle_preemptions")

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(f"wait_for_layer_load:{layer_name.split('.')[3]}")

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert kv_layer is self.registered[layer_name]
        self.calls.append(f"save_kv_layer:{layer_name.split('.')[3]}")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append("get_finished")
        for req_id in finished_req_ids:
            self._pending[req_id] = self.rank
        done = {req_id for req_id, left in self._pending.items() if left == 0}
        self._pending = {req_id: left - 1 for req_id, left in self._pending.items() if left > 0}
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("get_block_ids_with_load_errors")
        return set()

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        super().clear_connector_metadata()


class SimRecordingEC(ECConnectorBase):
    """An ``ec_both`` connector with an empty store that records the worker-side calls."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.calls: list[str] = []

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.calls.append("start_load_caches")

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        assert mm_hash in encoder_cache
        self.calls.append(f"save_caches:{mm_hash}")

    def has_cache_item(self, identifier: str) -> bool:
        return False

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        return ECConnectorMetadata()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_save_caches(self, **kwargs: Any) -> None:
        assert "encoder_cache" in kwargs
        self.calls.append("start_save_caches")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append("get_finished")
        return None, None

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear_connector_metadata")
        super().clear_connector_metadata()


def _expected_embeddings(items: list[MMItem]) -> dict[str, torch.Tensor]:
    return {item.identifier: embedding_for(item.identifier, item.length, HIDDEN) for item in items}


def _assert_embeddings(used: dict[str, torch.Tensor], items: list[MMItem]) -> None:
    expected = _expected_embeddings(items)
    assert used.keys() == expected.keys()
    for mm_hash, tensor in used.items():
        assert torch.equal(tensor, expected[mm_hash]), mm_hash


# -- no connector ----------------------------------------------------------------------------------------


def test_text_requests_run_to_completion(make_sim: Any) -> None:
    sim = make_sim(max_num_seqs=4)
    lengths = {"t1": (40, 3), "t2": (17, 1), "t3": (70, 5)}
    for i, (req_id, (prompt, max_tokens)) in enumerate(lengths.items()):  # disjoint: no prefix-cache hits
        sim.add_request(req_id, list(range(100 * i, 100 * i + prompt)), max_tokens=max_tokens)
    assert sim.leak_check()  # three live requests: the check must see them
    records = sim.run_until_idle()
    for req_id, (prompt, max_tokens) in lengths.items():
        assert sim.outputs[req_id] == [7] * max_tokens
        assert sim.finish_reasons[req_id] == "length"
        assert sim.tokens_computed[req_id] == prompt + max_tokens - 1
    assert all(record.schedule_ns > 0 for record in records)
    assert records[0].running == ("t1", "t2", "t3")
    assert sim.encoder_runs() == []
    assert sim.leak_check() == []


def test_multimodal_chunked_prefill_across_two_images(make_sim: Any) -> None:
    sim = make_sim(max_num_batched_tokens=32)
    items = [MMItem("img-a", offset=10, length=30), MMItem("img-b", offset=50, length=30)]
    sim.add_request("mm", list(range(100)), max_tokens=2, mm_items=items)
    records = sim.run_until_idle()
    prefill_steps = [r for r in records if r.num_scheduled_tokens.get("mm", 0) > 1]
    assert len(prefill_steps) >= 4  # 100 prompt tokens through a 32-token budget
    assert sorted(sim.encoder_runs()) == [("mm", "img-a"), ("mm", "img-b")]
    _assert_embeddings(sim.embeddings_used("mm"), items)
    assert sim.outputs["mm"] == [7, 7]
    assert sim.leak_check() == []


def test_two_requests_sharing_an_image_encode_it_once(make_sim: Any) -> None:
    sim = make_sim()
    item = MMItem("shared", offset=4, length=20)
    sim.add_request("a", list(range(30)), max_tokens=1, mm_items=[item])
    sim.add_request("b", list(range(1, 31)), max_tokens=1, mm_items=[item])
    sim.run_until_idle()
    assert [h for _, h in sim.encoder_runs()] == ["shared"]
    _assert_embeddings(sim.embeddings_used("a"), [item])
    _assert_embeddings(sim.embeddings_used("b"), [item])
    assert sim.leak_check() == []


def test_abort_running_and_waiting_requests(make_sim: Any) -> None:
    sim = make_sim(max_num_seqs=1)
    sim.add_request("run", list(range(20)), max_tokens=50)
    sim.add_request("wait", list(range(20)), max_tokens=50, mm_items=[MMItem("img", 2, 8)])
    record = sim.step()
    assert record.running == ("run",) and record.waiting == ("wait",)
    assert sim.abort("run") is True
    assert sim.abort("wait") is True
    assert sim.abort("run") is False  # already finished: not an error, as with a late client disconnect
    with pytest.raises(SimulationError, match="unknown request"):
        sim.abort("never-added")
    sim.run_until_idle()
    assert sim.finish_reasons == {"run": "abort", "wait": "abort"}
    assert sim.leak_check() == []


def test_preemption_under_kv_pressure(make_sim: Any) -> None:
    shape = SimShape(num_blocks=9)  # 8 usable blocks of 16 tokens; three requests want 5 each by the end
    sim = make_sim(shape=shape, max_num_seqs=3)
    for i in range(3):
        sim.add_request(f"p{i}", list(range(i, i + 40)), max_tokens=40)
    records = sim.run_until_idle()
    preempted = set().union(*(r.preempted for r in records))
    assert preempted
    for i in range(3):
        assert sim.outputs[f"p{i}"] == [7] * 40
    assert sum(sim.tokens_computed.values()) > 3 * (40 + 39)  # preempted requests recomputed their KV
    assert sim.leak_check() == []


def test_bad_requests_are_rejected_before_vllm_sees_them(make_sim: Any) -> None:
    sim = make_sim(max_model_len=128, max_num_batched_tokens=64)
    sim.add_request("ok", [1, 2, 3], max_tokens=1)
    cases: list[tuple[str, list[int], int, list[MMItem], str]] = [
        ("ok", [1], 1, [], "already used"),
        ("empty", [], 1, [], "empty prompt"),
        ("vocab", [1, 5000], 1, [], "outside"),
        ("zero", [1], 0, [], "max_tokens"),
        ("long", list(range(120)), 20, [], "max_model_len"),
        ("item-out", list(range(10)), 1, [MMItem("x", 5, 10)], "leaves the prompt"),
        ("overlap", list(range(40)), 1, [MMItem("x", 5, 10), MMItem("y", 10, 5)], "overlaps"),
        ("huge-item", list(range(120)), 1, [MMItem("x", 0, 100)], "encoder budget"),
    ]
    for req_id, tokens, max_tokens, items, message in cases:
        with pytest.raises(SimulationError, match=message):
            sim.add_request(req_id, tokens, max_tokens=max_tokens, mm_items=items)
    assert sorted(sim.scheduler.requests) == ["ok"]
    sim.run_until_idle()
    assert sim.leak_check() == []


def test_bad_engine_arguments(make_sim: Any, sim_model_dir: Path) -> None:
    with pytest.raises(SimulationError, match="num_workers"):
        make_sim(num_workers=0)
    with pytest.raises(SimulationError, match="does not split"):
        make_sim(num_workers=3)
    with pytest.raises(SimulationError, match="kv_load_failure_policy"):
        make_sim(kv_load_failure_policy="retry")
    with pytest.raises(SimulationError, match="ec role"):
        make_sim(ec=ConnectorSpec("SimRecordingEC", __name__, "producer"))


def test_an_embedding_neither_encoded_nor_loaded_is_an_error(make_sim: Any) -> None:
    worker = make_sim().workers[0]
    row = ScheduledRows(
        req_id="r",
        token_ids=torch.tensor([1]),
        positions=torch.tensor([0]),
        slot_mapping=torch.tensor([16]),
        sample=True,
        gathers=(GatheredRows("r", "missing", 0, 1),),
    )
    with pytest.raises(SimulationError, match="encoder cache miss"):
        worker._gather(StepPlan(scheduler_output=None, rows=(row,), encoder_items=()), WorkerStepResult(None))


def test_leak_check_names_what_is_held(make_sim: Any) -> None:
    sim = make_sim(max_num_batched_tokens=16, encoder_budget=32)  # the image is still prefilling after a step
    sim.add_request("held", list(range(40)), max_tokens=5, mm_items=[MMItem("img", 10, 20)])
    sim.step()
    problems = "\n".join(sim.leak_check())
    assert "held" in problems and "KV blocks not free" in problems and "encoder cache" in problems
    sim.run_until_idle()
    assert sim.leak_check() == []


# -- vLLM's example connectors ----------------------------------------------------------------------------


def test_ec_example_connector_producer_then_consumer(make_sim: Any, tmp_path: Path) -> None:
    store = {"shared_storage_path": str(tmp_path / "ec")}
    (tmp_path / "ec").mkdir()
    producer = make_sim(ec=ConnectorSpec("ECExampleConnector", None, "ec_producer", store))
    stored = MMItem("img-stored", offset=8, length=24)
    producer.add_request("e1", list(range(60)), max_tokens=5, mm_items=[stored])
    producer.run_until_idle()
    assert producer.encoder_runs() == [("e1", "img-stored")]
    assert producer.outputs["e1"] == [] and producer.finish_reasons["e1"] == "stop"  # E never samples
    assert producer.leak_check() == []

    consumer = make_sim(ec=ConnectorSpec("ECExampleConnector", None, "ec_consumer", store), num_workers=2)
    fresh = MMItem("img-fresh", offset=40, length=12)
    consumer.add_request("pd1", list(range(60)), max_tokens=3, mm_items=[stored, fresh])
    consumer.run_until_idle()
    assert consumer.encoder_runs() == [("pd1", "img-fresh")]  # the stored item was loaded, not encoded
    _assert_embeddings(consumer.embeddings_used("pd1"), [stored, fresh])
    for worker in consumer.workers:  # both TP workers loaded it
        assert torch.equal(worker.encoder_cache["img-stored"], embedding_for("img-stored", 24, HIDDEN))
    assert consumer.outputs["pd1"] == [7, 7, 7]
    assert consumer.leak_check() == []


def test_kv_example_connector_save_then_load(make_sim: Any, tmp_path: Path) -> None:
    store = {"shared_storage_path": str(tmp_path / "kv")}
    prompt = list(range(100, 170))
    producer = make_sim(kv=ConnectorSpec("ExampleConnector", KV_EXAMPLE, "kv_both", store))
    producer.add_request("p", prompt, max_tokens=2)
    producer.run_until_idle()
    assert producer.tokens_computed["p"] == 71
    assert producer.leak_check() == []

    consumer = make_sim(kv=ConnectorSpec("ExampleConnector", KV_EXAMPLE, "kv_both", store))
    consumer.add_request("d", prompt, max_tokens=2)
    first = consumer.step()
    assert first.num_scheduled_tokens == {"d": 70 - 64}  # 4 full blocks came from the store
    got = consumer.read_kv("d")
    expected = consumer.expected_kv(prompt)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    consumer.run_until_idle()
    assert consumer.tokens_computed["d"] == 7
    assert consumer.leak_check() == []


# -- call order and TP merging, with recording connectors ------------------------------------------------


def test_kv_worker_call_order_and_tp_merge_of_finished_sending(make_sim: Any) -> None:
    sim = make_sim(kv=ConnectorSpec("SimRecordingKV", __name__, "kv_both"), num_workers=2)
    for rank, worker in enumerate(sim.workers):
        worker.kv_connector.rank = rank
        assert worker.kv_connector.calls == ["register_kv_caches"]
        shapes = {tuple(t.shape) for t in worker.kv_connector.registered.values()}
        assert shapes == {(64, 1, 16, 8)}  # [blocks, local kv heads, block size, K+V channels]
        worker.kv_connector.calls.clear()

    sim.add_request("r", list(range(20)), max_tokens=2)
    sim.step()
    assert sim.workers[0].kv_connector.calls == [
        "handle_preemptions",
        "bind_connector_metadata",
        "wait_for_layer_load:0",
        "save_kv_layer:0",
        "wait_for_layer_load:1",
        "save_kv_layer:1",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    finished = sim.step()
    assert finished.finished == {"r": "length"}
    held = sim.step()  # rank 0 reported the send, rank 1 not yet: the blocks must still be held
    assert held.kv_connector_output is None or not held.kv_connector_output.finished_sending
    assert "r" in sim.scheduler.requests and sim.leak_check()
    no_forward = sim.workers[0].kv_connector.calls[-7:]
    assert no_forward == [
        "handle_preemptions",
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    released = sim.step()
    assert released.kv_connector_output.finished_sending == {"r"}
    assert sim.leak_check() == []


def test_ec_worker_call_order(make_sim: Any) -> None:
    sim = make_sim(ec=ConnectorSpec("SimRecordingEC", __name__, "ec_both"))
    sim.add_request("r", list(range(30)), max_tokens=1, mm_items=[MMItem("img", 4, 10)])
    sim.step()
    assert sim.workers[0].ec_connector.calls == [
        "bind_connector_metadata",
        "start_save_caches",
        "start_load_caches",
        "save_caches:img",
        "get_finished",
        "clear_connector_metadata",
    ]
    sim.run_until_idle()
    assert sim.leak_check() == []


class _LoadMetadata(KVConnectorMetadata):
    """Per request: the block ids to fill and the prompt tokens whose KV goes there."""

    def __init__(self, loads: dict[str, tuple[list[int], list[int]]]) -> None:
        self.loads = loads


class SimAsyncLoadKV(KVConnectorBase_V1):
    """Claims the first two blocks of every prompt are remote and loads them asynchronously: the request
    parks in WAITING_FOR_REMOTE_KVS, the worker writes the blocks in ``start_load_kv`` (through the forward
    context, as real connectors do) and reports them received one step later."""

    HIT = 32

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._asked: set[str] = set()
        self._loads: dict[str, tuple[list[int], list[int]]] = {}
        self._received: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._asked:
            return 0, False
        self._asked.add(request.request_id)
        return self.HIT - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            block_ids = blocks.get_block_ids()[0][: self.HIT // 16]
            self._loads[request.request_id] = (block_ids, list(request.prompt_token_ids[: self.HIT]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = _LoadMetadata(dict(self._loads))
        self._loads.clear()
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        from asyncconn_tools.sim.engine import kv_values

        meta = self._get_connector_metadata()
        assert isinstance(meta, _LoadMetadata)
        for req_id, (block_ids, tokens) in meta.loads.items():
            positions = torch.arange(len(tokens))
            blocks = torch.tensor(block_ids)[positions // 16]
            for index, (name, layer) in enumerate(forward_context.no_compile_layers.items()):
                kv = layer.kv_cache
                values = kv_values(
                    torch.tensor(tokens), positions, index, torch.arange(kv.shape[1]), kv.shape[3]
                )
                kv[blocks, :, positions % 16] = values
            self._received.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._received = self._received, set()
        return None, done or None


def test_async_kv_load_parks_the_request_then_resumes(make_sim: Any) -> None:
    sim = make_sim(kv=ConnectorSpec("SimAsyncLoadKV", __name__, "kv_both"))
    prompt = list(range(300, 340))
    sim.add_request("a", prompt, max_tokens=2)
    parked = sim.step()
    assert parked.num_scheduled_tokens == {} and parked.waiting == ("a",)
    assert parked.kv_connector_output.finished_recving == {"a"}
    sim.step()
    assert sim.tokens_computed["a"] == 40 - SimAsyncLoadKV.HIT
    got, expected = sim.read_kv("a"), sim.expected_kv(prompt)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    sim.run_until_idle()
    assert sim.outputs["a"] == [7, 7]
    assert sim.leak_check() == []


class SimFailingLoadKV(SimAsyncLoadKV):
    """Like :class:`SimAsyncLoadKV`, but reports every block it "loaded" as failed in the same step."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._failed: set[int] = set()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _LoadMetadata)
        for req_id, (block_ids, _tokens) in meta.loads.items():
            self._failed.update(block_ids)  # nothing written: the blocks keep whatever they held
            self._received.add(req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed


def test_failed_kv_load_fails_the_request_by_default(make_sim: Any) -> None:
    sim = make_sim(kv=ConnectorSpec("SimFailingLoadKV", __name__, "kv_both"))
    sim.add_request("f", list(range(500, 540)), max_tokens=2)
    sim.run_until_idle()
    assert sim.finish_reasons["f"] == "error"
    assert sim.tokens_computed["f"] == 0
    assert sim.leak_check() == []


def test_failed_kv_load_is_recomputed_under_the_recompute_policy(make_sim: Any) -> None:
    sim = make_sim(
        kv=ConnectorSpec("SimFailingLoadKV", __name__, "kv_both"), kv_load_failure_policy="recompute"
    )
    prompt = list(range(500, 540))
    sim.add_request("f", prompt, max_tokens=2)
    failed = sim.step()
    assert failed.kv_connector_output.invalid_block_ids
    sim.step()
    assert sim.tokens_computed["f"] == 40  # the whole prompt, the "loaded" part included
    got, expected = sim.read_kv("f"), sim.expected_kv(prompt)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    sim.run_until_idle()
    assert sim.outputs["f"] == [7, 7]
    assert sim.leak_check() == []
