"""Who may use an API without a key: this machine's own programs and the API's own pages.

Without a key anyone who reaches the port may ask, so the CLI binds a keyless API to loopback only.
A web page the operator visits still reaches loopback, two ways: DNS rebinding (a name of the
page's own that resolves to 127.0.0.1, so the browser lets the page read answers and the console as
its own) and cross-site requests (a form or fetch the browser sends even though the page may not
read the reply: the ask still runs). So a keyless API answers only a request whose Host names this
machine (localhost, a loopback address, or the address the API is bound to), whose Origin, if it
has one, is the API's own, and whose POST body is declared JSON: a cross-site page can send a body
only as a form or plain text unless the browser first asks the API's leave, which it never gets.
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers

from meshd.front.door import ApiError, Problem

# Names that always mean this machine (browsers resolve them without asking DNS).
LOCAL_NAMES = frozenset({"localhost"})
# The one body type a POST may declare.
JSON_TYPE = "application/json"
# A header value quoted back in a refusal is cut here: it is the client's, of any length h11 allows.
MAX_QUOTED = 80


def host_name(host: str) -> str | None:
    """A Host header's name without its port (an IPv6 literal without brackets); None if malformed."""
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket:
            return None
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name.lower()


def is_local(name: str, bound: str | None) -> bool:
    """Whether `name` means this machine: a local name, a loopback address or the bound address."""
    if name in LOCAL_NAMES or name == bound:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def refusal(method: str, headers: Headers, scheme: str, bound: str | None) -> ApiError | None:
    """Why a keyless API refuses this request, or None: it may ask. `bound` is the address that took it."""
    host = headers.get("host", "")
    name = host_name(host)
    if name is None or not is_local(name, bound):
        return ApiError(Problem.FORBIDDEN, f"this API has no key, so it answers only requests addressed to this "
                                           f"machine (Host localhost or a loopback address), not Host "
                                           f"{host[:MAX_QUOTED]!r}")
    origin = headers.get("origin")
    if origin is not None and origin.lower() != f"{scheme}://{host.lower()}":
        return ApiError(Problem.FORBIDDEN, f"a request from another site (Origin {origin[:MAX_QUOTED]!r}) needs an "
                                           f"API key, and this API has none")
    if method == "POST":
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != JSON_TYPE:
            return ApiError(Problem.UNSUPPORTED_MEDIA, f"send the request body as JSON with Content-Type: {JSON_TYPE} "
                                                       f"(not {media[:MAX_QUOTED] or 'no Content-Type'})")
    return None
