"""Name what went wrong with a connection, one way for the backend, the smoke test and model discovery.

aiohttp's exceptions are mapped to a failure kind (records.FAILURE_KINDS) and a message that says what
actually happened: a refused connection, a DNS failure, a TLS failure, a redirect loop, or a server that
accepted the connection and closed it before answering. Only the first two (and other connect-level
failures) mean "could not be reached"; the others reached a server that misbehaved.
"""

from __future__ import annotations

import aiohttp

__all__ = ["UNREACHABLE_KINDS", "classify_client_error"]

# Failure kinds after which "is the server running?" is the right question.
UNREACHABLE_KINDS = ("connection_error", "dns_error")


def classify_client_error(exc: aiohttp.ClientError, *, after_headers: bool) -> tuple[str, str]:
    """(failure kind, message) for an aiohttp error; `after_headers`: the response had started.

    Kinds: "too_many_redirects", "tls_error", "dns_error", "connection_error" (refused or
    unreachable), "connection_closed" (the server closed the connection before answering),
    "stream_cut" (the connection broke mid-stream).
    """
    name = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.TooManyRedirects):
        hops = len(exc.history)
        return "too_many_redirects", f"too many redirects ({hops} followed, a redirect loop?): {name}"
    if isinstance(exc, aiohttp.ClientSSLError | aiohttp.ClientConnectorCertificateError):
        return "tls_error", f"TLS handshake or certificate failed: {name}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "dns_error", f"DNS lookup of the host failed: {name}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection_error", f"connection refused: {name}"
        return "connection_error", f"could not connect: {name}"
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        if after_headers:
            return "stream_cut", f"the connection broke mid-stream: {name}"
        return "connection_closed", f"the server closed the connection without answering: {name}"
    return "connection_error", name
