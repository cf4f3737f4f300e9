"""uvicorn's h11 HTTP protocol with a deadline on a request's headers.

uvicorn closes a keep-alive connection that stays idle, but once a client has sent a request's
first byte it waits for the rest of the headers for ever: a client sending one header byte a
minute (slowloris) holds a connection, a file descriptor and a task indefinitely, and a few
thousand of them exhaust the process. Here a timer starts when a connection opens, and again when
the first byte of a later request arrives on it; it stops when h11 has read the request's headers.
If it fires first, the connection is closed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take longer than ``header_timeout`` s."""

    header_timeout = 30.0  # set on a subclass per server (`with_header_timeout`): uvicorn builds the protocol itself

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # between requests: a new one begins
            self._start_header_timer()
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # h11 produced the request: its headers are complete
            self._stop_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`) for a header deadline of `seconds`."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": seconds})
