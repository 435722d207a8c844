"""The security posture, each claim with a test.

Claims proved elsewhere and referenced here rather than duplicated:
- Redis with a password works and a wrong/missing password fails clearly:
  ``tests/backends/test_redis.py::test_password_auth`` and ``::test_wrong_or_missing_password_fails_clearly``.
- TLS through ``rediss://`` against a CA made in the test:
  ``tests/backends/test_redis.py::test_tls_round_trip``.
- The ipc socket file is 0600: ``tests/lookup/test_server.py::test_ipc_socket_file_is_private``.
- Frames over ``max_message`` drop the peer and over ``max_keys`` get an error reply:
  ``tests/lookup/test_server.py::test_oversized_frame_is_dropped_and_server_keeps_serving`` and
  ``::test_malformed_gets_error_reply_and_server_keeps_serving[more hashes than the cap]``.
"""

from __future__ import annotations

import ast
import asyncio
import io
import logging
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio
import zmq.auth

from asyncconn import codec
from asyncconn.backend import open_backend
from asyncconn.cli.main import main as cli_main
from asyncconn.exceptions import AsyncConnError, ConfigError
from asyncconn.lookup import PREFIX, LookupClient, LookupServer, ZmqTransport, store_key
from asyncconn.lookup.curve import CurveClientKeys, CurveServerKeys, is_loopback, load_key
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.lookup.server import DEFAULT_BIND
from asyncconn.runtime import Runtime
from asyncconn.store import Fetch, TensorStore
from tests.lookup.fakes import wait_until
from tests.servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
SECRET = "Zq7-very-secret-Pa55word"
HASHES = [bytes([i]) * 32 for i in range(4)]


# -- (a) nothing read from a store or socket is unpickled or evaluated ---------------------------------
_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
_BANNED_CALLS = {"eval", "exec", "__import__"}
_BANNED_ATTRS = {
    ("torch", "load"),
    ("numpy", "load"),
    ("np", "load"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
}


def deserialization_uses(source: str, filename: str) -> list[str]:
    """Every import of a pickle-like module and every eval/exec/torch.load-style call in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [
                f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in _BANNED_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _BANNED_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _BANNED_CALLS:
                found.append(f"{where} {func.id}()")
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if (func.value.id, func.attr) in _BANNED_ATTRS or func.value.id in _BANNED_MODULES:
                    found.append(f"{where} {func.value.id}.{func.attr}()")
    return found


def test_the_scanner_catches_every_banned_form() -> None:
    planted = (
        "import pickle\nfrom marshal import loads\nimport torch\n"
        "x = eval('1')\nexec('y = 1')\nt = torch.load('f')\nimport cloudpickle as cp\nnp.load('a')\n"
    )
    assert len(deserialization_uses(planted, "planted.py")) == 7
    assert deserialization_uses("import json\nx = json.loads('1')\nmodel.eval()\n", "ok.py") == []


def test_package_source_never_unpickles_or_evaluates() -> None:
    files = sorted([*(ROOT / "asyncconn").rglob("*.py"), *(ROOT / "backends").rglob("*.py")])
    assert len(files) > 20  # the scan really walked the package
    found = [hit for f in files for hit in deserialization_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


class _Bomb:
    """Unpickling this creates ``path``: the marker that proves code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _bomb(path: Path) -> bytes:
    payload = pickle.dumps(_Bomb(path))
    probe = path.with_suffix(".probe")
    pickle.loads(pickle.dumps(_Bomb(probe)))  # the payload is live: unpickled, it does create a file
    assert probe.exists()
    return payload


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_a_pickle_payload_in_the_store_is_a_miss_never_executed(
    tmp_path: Path, redis_server: RedisServer, where: str
) -> None:
    marker = tmp_path / "pwned"
    payload = _bomb(marker)
    url = "memory://sec-pickle" if where == "memory" else redis_server.url + "?prefix=sec-pickle:"
    store = await TensorStore.open(url)
    try:
        saved = io.BytesIO()
        torch.save(torch.ones(3), saved)  # a torch.save file (a zip of pickles) is not a frame either
        await store.backend.put([("k", payload), ("t", saved.getvalue())])
        assert await store.get(["k", "t"]) == [None, None]
        assert await store.read_into("k", torch.empty(4)) is Fetch.CORRUPT
        assert await store.read_into("t", torch.empty(3)) is Fetch.CORRUPT
        assert store.stats.corrupt == 4
        with pytest.raises(AsyncConnError):
            codec.decode(payload)
    finally:
        await store.close()
    assert not marker.exists()


def test_a_pickle_payload_sent_to_the_lookup_server_gets_an_error_reply(rt: Runtime, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = _bomb(marker)
    srv = _start(rt)
    try:
        with _req(srv) as sock:
            for frames in (
                [payload],
                [b"lookup", payload, payload, payload],
                [b"exists", b"x", payload, b""],
            ):
                sock.send_multipart(frames)
                assert sock.recv() == b"\x00"
            sock.send_multipart(encode_mooncake_lookup(32, HASHES[:2]))
            assert sock.recv() == struct.pack(">I", 32)
    finally:
        rt.run(srv.close())
    assert not marker.exists()


# -- (c) bind defaults, caps, CURVE ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="security-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


def _start(rt: Runtime, bind: str = "tcp://127.0.0.1:*", **kw: object) -> LookupServer:
    async def go() -> LookupServer:
        store = await TensorStore.open("memory://sec-lookup")
        await store.backend.put([(store_key("", h), b"v") for h in HASHES])
        server = LookupServer(store, bind, **kw)  # type: ignore[arg-type]
        await server.start()
        return server

    return rt.run(go())


class _req:
    """A REQ socket that gives up after ``timeout_ms`` (a refused handshake must fail, not hang)."""

    def __init__(self, server: LookupServer, curve: CurveClientKeys | None = None, timeout_ms: int = 5000):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        if curve is not None:
            self.sock.curve_serverkey = curve.server_public
            pub, sec = (curve.public, curve.secret) if curve.public else zmq.curve_keypair()
            self.sock.curve_publickey, self.sock.curve_secretkey = pub, sec
        assert server.endpoint is not None
        self.sock.connect(server.endpoint)

    def __enter__(self) -> zmq.Socket[bytes]:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close(0)
        self.ctx.term()


def _answers(server: LookupServer, curve: CurveClientKeys | None, timeout_ms: int = 5000) -> bool:
    with _req(server, curve, timeout_ms) as sock:
        sock.send_multipart(encode_mooncake_lookup(64, HASHES))
        try:
            return sock.recv() == struct.pack(">I", 64)
        except zmq.Again:
            return False


def test_default_binds_are_local() -> None:
    assert DEFAULT_BIND.startswith("tcp://127.0.0.1:")
    assert is_loopback(DEFAULT_BIND) and is_loopback("ipc:///tmp/x.sock") and is_loopback("tcp://[::1]:1")
    assert not is_loopback("tcp://0.0.0.0:5570") and not is_loopback("tcp://10.1.2.3:5570")
    assert not is_loopback("tcp://eth0:5570") and not is_loopback("tcp://[::]:5570")


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://eth0:*"])
def test_a_network_bind_without_curve_is_refused(rt: Runtime, bind: str) -> None:
    async def go() -> None:
        server = LookupServer(TensorStore(await open_backend("memory://sec-refuse")), bind)
        try:
            with pytest.raises(ConfigError, match="insecure"):
                await server.start()
            assert server.endpoint is None
        finally:
            await server.close()

    rt.run(go())


def test_a_network_bind_is_allowed_with_curve_or_insecure(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncconn"):
        srv = _start(rt, "tcp://0.0.0.0:*", insecure=True)
        rt.run(srv.close())
    assert any("no authentication" in r.getMessage() for r in caplog.records)
    caplog.clear()
    keys = CurveServerKeys.generate()
    with caplog.at_level(logging.WARNING, logger="asyncconn"):
        srv = _start(rt, "tcp://0.0.0.0:*", curve=keys)
    try:
        assert not any("no authentication" in r.getMessage() for r in caplog.records)
        assert srv.endpoint is not None
        port = srv.endpoint.rsplit(":", 1)[1]
        srv.endpoint = f"tcp://127.0.0.1:{port}"  # reach it over loopback
        assert _answers(srv, CurveClientKeys(keys.public))
    finally:
        rt.run(srv.close())


def test_curve_forced_on_loopback_admits_only_clients_that_know_the_server_key(rt: Runtime) -> None:
    keys = CurveServerKeys.generate()
    srv = _start(rt, curve=keys)
    try:
        assert _answers(srv, CurveClientKeys(keys.public))
        assert not _answers(srv, None, timeout_ms=300)  # plaintext client: handshake refused, no reply
        other = CurveServerKeys.generate()
        assert not _answers(srv, CurveClientKeys(other.public), timeout_ms=300)  # wrong server key
        assert _answers(srv, CurveClientKeys(keys.public))  # still serving after refusals
        assert srv.stats.errors == 0 and srv.stats.requests == 2
    finally:
        rt.run(srv.close())


def test_curve_client_allow_list(rt: Runtime, tmp_path: Path) -> None:
    allowed_dir, other_dir = tmp_path / "allowed", tmp_path / "other"
    allowed_dir.mkdir()
    other_dir.mkdir()
    pub_file, sec_file = zmq.auth.create_certificates(str(allowed_dir), "client")
    _, stranger_sec = zmq.auth.create_certificates(str(other_dir), "stranger")
    keys = CurveServerKeys.generate(clients_dir=allowed_dir)
    srv = _start(rt, curve=keys)
    try:
        good = CurveClientKeys(
            keys.public, load_key(sec_file), load_key(sec_file, secret=True)
        )  # public and secret of the allowed client
        stranger = CurveClientKeys(keys.public, load_key(stranger_sec), load_key(stranger_sec, secret=True))
        assert _answers(srv, good)
        assert not _answers(srv, stranger, timeout_ms=300)
        assert not _answers(srv, CurveClientKeys(keys.public), timeout_ms=300)  # a fresh, unknown key pair
        assert _answers(srv, good)
        assert pub_file != sec_file
    finally:
        rt.run(srv.close())


def test_pipelined_client_over_curve(rt: Runtime) -> None:
    keys = CurveServerKeys.generate()
    srv = _start(rt, curve=keys)
    assert srv.endpoint is not None
    client = LookupClient(
        ZmqTransport(srv.endpoint, curve=CurveClientKeys(keys.public)), PREFIX, runtime=rt, timeout=5.0
    )
    try:
        for i in range(50):
            client.submit(f"r{i}", HASHES[: i % 4 + 1])
        wait_until(lambda: client.metrics.completed == 50)
        assert [client.poll(f"r{i}") for i in range(50)] == [i % 4 + 1 for i in range(50)]
        assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    finally:
        client.close()
        rt.run(srv.close())


def test_curve_keys_from_strings_and_files_and_bad_keys(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    assert load_key(secret.decode()) == secret
    (tmp_path / "bare.key").write_bytes(secret + b"\n")
    assert load_key(str(tmp_path / "bare.key")) == secret
    pub_file, sec_file = zmq.auth.create_certificates(str(tmp_path), "srv")
    loaded = load_key(sec_file, secret=True)
    assert CurveServerKeys(loaded).public == load_key(pub_file)
    with pytest.raises(ConfigError, match="no secret key"):
        load_key(pub_file, secret=True)
    wrong = "Q" * 39 + "~"  # 40 characters, '~' is not Z85
    for bad in (wrong, "short", str(tmp_path / "missing.key")):
        with pytest.raises(ConfigError) as info:
            load_key(bad, what="--curve-secret-key")
        assert "--curve-secret-key" in str(info.value)
        assert wrong not in str(info.value)  # a (possibly secret) key is never echoed
    with pytest.raises(ConfigError):
        CurveServerKeys(secret, clients_dir=tmp_path / "nope")
    with pytest.raises(ConfigError):
        CurveClientKeys(public, public=public)


def test_cli_refuses_a_network_bind_without_curve(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["lookup-server", "--backend", "memory://sec-cli", "--bind", "tcp://0.0.0.0:0"])
    assert code == 2
    assert "--insecure" in capsys.readouterr().err


def test_cli_bad_curve_key_exits_2_without_echoing_it(capsys: pytest.CaptureFixture[str]) -> None:
    bad = "S" * 39 + "~"
    code = cli_main(["lookup-server", "--backend", "memory://sec-cli", "--curve-secret-key", bad])
    err = capsys.readouterr().err
    assert code == 2 and "--curve-secret-key" in err and bad not in err


# -- (d) secrets never reach logs or error messages -----------------------------------------------------
def _texts(exc: BaseException | None) -> list[str]:
    out: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out += [str(exc), repr(exc)]
        exc = exc.__cause__ or exc.__context__
    return out


def _assert_clean(texts: list[str], caplog: pytest.LogCaptureFixture) -> None:
    records = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    leaks = [t for t in [*texts, *records] if SECRET in t]
    assert leaks == []


@pytest.fixture(scope="module")
def secret_redis() -> Iterator[RedisServer]:
    server = RedisServer(password=SECRET).start()
    try:
        yield server
    finally:
        server.stop()


async def test_secrets_absent_from_failing_auth_and_bad_urls(
    secret_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port, dead = secret_redis.port, free_port()
    texts: list[str] = []
    wrong = f"redis://:{SECRET}-wrong@127.0.0.1:{port}/0?timeout=2"
    bad_urls = [
        wrong,
        f"redis://user:{SECRET}@127.0.0.1:{port}/0?bogus=1",
        f"redis://:{SECRET}@127.0.0.1:notaport/0",
        f"redis://{SECRET}@127.0.0.1:{dead}/0?timeout=1",
        f"redis://:{SECRET}@127.0.0.1:{dead}/0?timeout=1",
        f"redis://127.0.0.1:{port}/0?password={SECRET}-wrong&timeout=2",
        f"rediss://:{SECRET}@127.0.0.1:{port}/0?tls_ca=/nonexistent.pem&timeout=2",
    ]
    for url in bad_urls:
        with pytest.raises(AsyncConnError) as info:
            store = await TensorStore.open(url)
            try:
                await store.get(["k"])
            finally:
                await store.close()
        texts += _texts(info.value)
    _assert_clean(texts, caplog)
    # the right password works, and its store's name (used in every log line) is redacted
    store = await TensorStore.open(secret_redis.url + "?prefix=sec-ok:")
    try:
        await store.put([("k", torch.ones(3))])
        assert SECRET not in store.name and (await store.get(["k"]))[0] is not None
    finally:
        await store.close()


def test_secrets_absent_from_check_and_lookup_server_cli(
    secret_redis: RedisServer, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    dead = free_port()
    assert cli_main(["check", f"redis://:{SECRET}@127.0.0.1:{dead}/0", "--timeout", "2"]) != 0
    assert cli_main(["check", f"redis://:{SECRET}-x@127.0.0.1:{secret_redis.port}/0", "--timeout", "2"]) != 0
    code = cli_main(["lookup-server", "--backend", f"redis://:{SECRET}@127.0.0.1:{dead}/0?timeout=1"])
    assert code == 2
    backend = f"redis://:{SECRET}@127.0.0.1:{dead}/0?timeout=1"
    assert cli_main(["lookup-server", "--backend", backend, "--wait-for-store", "0.3s"]) == 2
    out = capsys.readouterr()
    assert "trying again" in out.err  # the retry lines are checked too
    assert "***" in out.out + out.err  # the URL was printed, redacted
    _assert_clean([out.out, out.err], caplog)


def test_secrets_absent_from_a_running_lookup_server(
    rt: Runtime, secret_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> list[str]:
        store = await TensorStore.open(secret_redis.url + "?prefix=sec-srv:")
        server = LookupServer(store, "tcp://127.0.0.1:*")
        try:
            endpoint = await server.start()
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.REQ)
            sock.connect(endpoint)
            await sock.send_multipart(encode_mooncake_lookup(32, HASHES[:2]))
            reply = await asyncio.wait_for(sock.recv(), 5)
            sock.close(0)
            ctx.term()
            return [endpoint, bytes(reply).hex(), repr(server.stats)]
        finally:
            await server.close()
            await store.close()

    texts = rt.run(go())
    assert any("serving" in r.getMessage() for r in caplog.records)  # the line naming the store was logged
    _assert_clean(texts, caplog)


def test_connector_settings_reach_a_curve_server(rt: Runtime, tmp_path: Path) -> None:
    """``lookup_server`` + ``lookup_server_key`` in extra_config give the connectors a CURVE client."""
    from asyncconn.config import Settings
    from asyncconn.lookup import LookupConfig, open_lookup_client

    keys = CurveServerKeys.generate()
    srv = _start(rt, curve=keys)
    assert srv.endpoint is not None
    key_file = tmp_path / "server.key"
    key_file.write_bytes(keys.public)
    settings = Settings.from_extra_config({"lookup_server": srv.endpoint, "lookup_server_key": str(key_file)})
    client = open_lookup_client(LookupConfig.from_settings(settings), PREFIX, runtime=rt)
    try:
        client.submit("r", HASHES[:3])
        wait_until(lambda: client.metrics.completed == 1)
        assert client.poll("r") == 3
    finally:
        client.close()
        rt.run(srv.close())
