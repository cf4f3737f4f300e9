"""What one client may ask of the server, and for how long it may hold it: `ServerLimits`.

Each limit bounds a way a single client (careless or hostile) could hurt the others, with a default
that normal use never meets; each is a `numba-vllm serve` option (docs/server.md):

- the body: at most ``max_request_bytes`` (413), read within ``body_timeout`` seconds (408);
- the headers: a connection must deliver a request's headers within ``header_timeout`` seconds of
  opening (or of sending the next request's first byte), else it is closed (`http_protocol.py`);
- prompts: at most ``max_prompts_per_request`` in one completions request (400): each becomes an
  engine request, so a 16 KB body could otherwise queue thousands;
- the queue: at most ``max_waiting_requests`` engine requests waiting for a batch slot; past that a
  request gets 503 with `Retry-After` instead of an ever longer wait;
- a stream whose client stops reading: when one write waits more than ``write_timeout`` seconds,
  the request is aborted (its slot and KV pages freed) and the connection closed;
- ``allowed_hosts``: if given, only requests whose `Host` header names one of them are served (400
  otherwise), so a web page that rebinds its own DNS name to 127.0.0.1 cannot reach a local server.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one client's requests (see the module docstring); all times in seconds."""

    max_request_bytes: int = 1 << 20
    max_prompts_per_request: int = 256
    max_waiting_requests: int = 1024
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    write_timeout: float = 60.0
    allowed_hosts: tuple[str, ...] | None = None  # host names (no port); None: any

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts_per_request", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def host_allowed(self, host_header: bytes | None) -> bool:
        """Whether a request's `Host` header (bytes, maybe with a port) names an allowed host."""
        if self.allowed_hosts is None:
            return True
        if host_header is None:
            return False
        host = host_header.decode("latin-1").strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1 : host.find("]")] if "]" in host else host
        else:
            host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return host in {h.lower() for h in self.allowed_hosts}
