"""The shape of pyzmq's ZAP authenticator that ``lookup.zap_hook`` relies on (a private method).

These fail when pyzmq renames ``Authenticator._send_zap_reply``, changes its signature, or stops sending
every verdict through it -- the signal to rework ``asyncconn/lookup/zap_hook.py`` before raising the
``pyzmq<28`` cap in pyproject.toml. No sockets: the authenticator is never started, its ZAP socket is a
stand-in that records what would be sent.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from zmq.auth.base import Authenticator

from asyncconn.lookup.gate import REFUSED
from asyncconn.lookup.zap_hook import VerdictAuthenticator

NULL_REQUEST = [b"1.0", b"req-1", b"asyncconn.lookup", b"127.0.0.1", b"", b"NULL"]


class _Recorder:
    """Where ``_send_zap_reply`` sends: ``send_multipart`` is all pyzmq calls on its ZAP socket."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(list(frames))


class _Hook(VerdictAuthenticator):
    def __init__(self, context: zmq.asyncio.Context, answer: tuple[bytes, bytes] | None) -> None:
        super().__init__(context)
        self.answer = answer
        self.asked = 0

    def refusal(self) -> tuple[bytes, bytes] | None:
        self.asked += 1
        return self.answer


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.term()


def _verdict(auth: _Hook, request: list[bytes]) -> list[bytes]:
    recorder = _Recorder()
    auth.zap_socket = recorder  # type: ignore[assignment]
    asyncio.run(auth.handle_zap_message(request))
    assert len(recorder.sent) == 1, recorder.sent
    return recorder.sent[0]


def test_send_zap_reply_has_the_signature_the_hook_overrides() -> None:
    method = inspect.getattr_static(Authenticator, "_send_zap_reply")
    assert inspect.isfunction(method) and not inspect.iscoroutinefunction(method)
    params = list(inspect.signature(method).parameters.values())
    assert [p.name for p in params] == ["self", "request_id", "status_code", "status_text", "user_id"]
    assert params[-1].default == "anonymous"
    # The hook's super() call lands on pyzmq's implementation, not on something in between.
    assert getattr(VerdictAuthenticator.__mro__[1], "_send_zap_reply") is Authenticator._send_zap_reply


def test_an_admission_passes_through_the_hook(context: zmq.asyncio.Context) -> None:
    auth = _Hook(context, None)
    assert _verdict(auth, NULL_REQUEST) == [b"1.0", b"req-1", b"200", b"OK", b"anonymous", b""]
    assert auth.asked == 1


def test_the_hook_turns_an_admission_into_a_refusal(context: zmq.asyncio.Context) -> None:
    auth = _Hook(context, REFUSED)
    assert _verdict(auth, NULL_REQUEST) == [b"1.0", b"req-1", *REFUSED, b"", b""]
    assert auth.asked == 1


def test_a_refusal_by_the_authenticator_is_never_asked_about(
    context: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """CURVE with an empty allow-list: pyzmq refuses, the hook is not consulted, the reason is pyzmq's."""
    auth = _Hook(context, None)
    auth.configure_curve(domain="*", location=str(tmp_path))
    curve_request = [*NULL_REQUEST[:5], b"CURVE", b"k" * 32]
    reply = _verdict(auth, curve_request)
    assert reply[2] == b"400" and reply[3] != REFUSED[1]
    assert auth.asked == 0
    bad_version = [b"9.9", *NULL_REQUEST[1:]]
    assert _verdict(auth, bad_version)[2] == b"400"
    assert auth.asked == 0
