"""The one place asyncconn reaches into pyzmq's ZAP authenticator: a say over every admission it sends.

Why a private method: :class:`~asyncconn.lookup.gate.ConnectionGate` must turn an admission into a refusal
(too many connections) *after* pyzmq's own checks -- CURVE's client allow-list above all -- have passed
it, and never the other way round. pyzmq's public API offers no such hook: ``handle_zap_message`` decides
and replies in one call, and the CURVE callback (``configure_curve_callback``) is neither consulted under
the NULL mechanism nor able to say why it refuses. Every reply ``handle_zap_message`` sends goes through
``Authenticator._send_zap_reply(request_id, status_code, status_text, user_id)``, so overriding that method
sees each verdict exactly once, with the authenticator's checks unchanged.

Replacing it with public API would mean re-implementing the authenticator's checks (a security boundary)
or answering before them (which would count strangers refused by the allow-list as refused by the bound).
So it stays, here only: :class:`VerdictAuthenticator` turns it into one hook, :meth:`refusal`, asked
only about admissions, and ``tests/lookup/test_zap_hook.py`` fails if pyzmq changes the method's name,
signature or role (pyproject.toml keeps pyzmq below its next major release until that test is re-run).
"""

from __future__ import annotations

from zmq.auth.asyncio import AsyncioAuthenticator

__all__ = ["VerdictAuthenticator"]


class VerdictAuthenticator(AsyncioAuthenticator):
    """pyzmq's asyncio ZAP authenticator that asks :meth:`refusal` before it admits a connection."""

    def refusal(self) -> tuple[bytes, bytes] | None:
        """A ZAP ``(status_code, status_text)`` to send instead of admitting a connection, or None to admit.

        Called on the loop once per connection the authenticator's own checks admit, just before the
        admission is sent; never for one they refuse, so an override can only ever refuse more.
        """
        return None

    def _send_zap_reply(
        self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = "anonymous"
    ) -> None:
        if status_code == b"200":
            instead = self.refusal()
            if instead is not None:
                (status_code, status_text), user_id = instead, ""  # a refusal names no user
        super()._send_zap_reply(request_id, status_code, status_text, user_id)
