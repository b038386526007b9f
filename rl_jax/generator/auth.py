"""API keys for the generator servers' HTTP control plane, in SGLang's scheme.

Two keys, each optional:

- the API key (SGLang's ``--api-key``) guards the normal endpoints (``/generate``, model and
  server information, loads, weight versions);
- the admin API key (SGLang's ``--admin-api-key``) guards every endpoint that changes the
  server: weight updates, pause and continue, aborts, cache flushes (:data:`ADMIN_PATHS`).

Who needs what, as in SGLang's ``decide_request_auth``:

====================  =======================  ======================================
keys set              normal endpoints         admin endpoints
====================  =======================  ======================================
none                  open                     open
API key only          API key                  API key
admin key only        open                     admin key
both                  API key                  admin key (the API key is refused)
====================  =======================  ======================================

``/health`` and ``/health_generate`` (and ``/metrics``) stay open for probes and routers. A key
is sent as ``Authorization: Bearer <key>`` (what SGLang, its router and OpenAI clients send) or
as ``x-api-key: <key>``, and compared in constant time. A refusal is JSON in the server's error
shape: 401 (``unauthorized``, with ``WWW-Authenticate: Bearer``) for a missing or wrong key at a
normal endpoint, 403 (``forbidden``) for anything but the admin key at an admin endpoint while
an admin key is set.

Keys come from a flag, a file or an environment variable (:func:`load_keys`); they are never
logged, never part of a ``repr``, and reach child processes through their environment or a
private file (never their command line, which ``ps`` and logs show).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

API_KEY_ENV = "RL_JAX_API_KEY"
ADMIN_API_KEY_ENV = "RL_JAX_ADMIN_API_KEY"

# Endpoints that change a server's state (weights, scheduling, queues, caches).
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights_from_transfer",
    "/update_weights_from_distributed", "/update_weights_from_tensor",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/begin_weight_update", "/end_weight_update",
    "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
    "/release_memory_occupation", "/resume_memory_occupation", "/update_weight_version",
    "/load_lora_adapter", "/unload_lora_adapter", "/set_internal_state",
    "/start_profile", "/stop_profile", "/configure_logging",
})
# Endpoints every prober may call without a key.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class AuthConfigError(ValueError):
    """A key that cannot be used (unreadable file, empty, or characters HTTP headers cannot
    carry)."""


class Keys:
    """A server's (or a client's) API key and admin API key; either may be ``None``.

    The values never appear in ``repr``/``str`` (logs, tracebacks, config dumps)."""

    __slots__ = ("api_key", "admin_api_key")

    def __init__(self, api_key: str | None = None, admin_api_key: str | None = None):
        object.__setattr__(self, "api_key", check_key(api_key, "api_key"))
        object.__setattr__(self, "admin_api_key", check_key(admin_api_key, "admin_api_key"))

    def __setattr__(self, name, value):
        raise AttributeError("Keys are immutable")

    def __bool__(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, Keys) and self.api_key == other.api_key
                and self.admin_api_key == other.admin_api_key)

    def __hash__(self) -> int:
        return hash((self.api_key, self.admin_api_key))

    def __repr__(self) -> str:
        api, admin = ("set" if key else "unset" for key in (self.api_key, self.admin_api_key))
        return f"Keys(api_key={api}, admin_api_key={admin})"

    def __reduce__(self):
        return (Keys, (self.api_key, self.admin_api_key))

    def key_for(self, path: str) -> str | None:
        """The key a client sends to ``path``: the admin key (or, without one, the API key) at
        an admin endpoint, the API key elsewhere (SGLang accepts only it there)."""
        if is_admin_path(path):
            return self.admin_api_key or self.api_key
        return self.api_key

    def headers_for(self, path: str) -> dict[str, str]:
        """``{"Authorization": "Bearer <key>"}`` for ``path``, or ``{}`` without a key."""
        key = self.key_for(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def environ(self) -> dict[str, str]:
        """The environment variables that hand these keys to a child server process (empty
        values are not set; see :func:`child_environ`)."""
        out = {}
        if self.api_key:
            out[API_KEY_ENV] = self.api_key
        if self.admin_api_key:
            out[ADMIN_API_KEY_ENV] = self.admin_api_key
        return out


def check_key(key: str | None, name: str) -> str | None:
    """``key`` if it can be sent in an HTTP header (printable ASCII, no spaces), ``None`` for
    ``None``; raises :class:`AuthConfigError` naming ``name`` (never the key) otherwise."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise AuthConfigError(f"{name} must be a string, got {type(key).__name__}")
    if not key:
        raise AuthConfigError(f"{name} is empty")
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise AuthConfigError(f"{name} must be printable ASCII without spaces (it travels in "
                              f"an HTTP header); the given one ({len(key)} characters) is not")
    return key


NO_KEYS = Keys()


def read_key_file(path: str | os.PathLike, name: str) -> str:
    """The key in file ``path`` (surrounding whitespace, e.g. a final newline, removed)."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise AuthConfigError(f"{name} file {str(path)!r} cannot be read: "
                              f"{type(e).__name__}") from None
    key = text.strip()
    if not key:
        raise AuthConfigError(f"{name} file {str(path)!r} is empty")
    return check_key(key, f"{name} (from {str(path)!r})")


def load_key(value: str | None = None, file: str | os.PathLike | None = None, *,
             env: str, name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One key: ``value`` (a flag), else the contents of ``file``, else environment variable
    ``env`` (unset or empty: no key). A flag and a file together are refused."""
    if value and file:
        raise AuthConfigError(f"give {name} or {name}_file, not both")
    if value:
        return check_key(value, name)
    if file:
        return read_key_file(file, f"{name}_file")
    environ = os.environ if environ is None else environ
    return check_key(environ.get(env) or None, f"environment variable {env}")


def load_keys(api_key: str | None = None, api_key_file: str | os.PathLike | None = None,
              admin_api_key: str | None = None,
              admin_api_key_file: str | os.PathLike | None = None, *,
              environ: Mapping[str, str] | None = None) -> Keys:
    """Both keys, each from its flag, file or environment variable (:data:`API_KEY_ENV`,
    :data:`ADMIN_API_KEY_ENV`)."""
    return Keys(load_key(api_key, api_key_file, env=API_KEY_ENV, name="api_key",
                         environ=environ),
                load_key(admin_api_key, admin_api_key_file, env=ADMIN_API_KEY_ENV,
                         name="admin_api_key", environ=environ))


def child_environ(base: Mapping[str, str], keys: Keys) -> dict[str, str]:
    """``base`` with the key variables set to ``keys`` exactly: inherited ones are dropped, so a
    child server has the keys its launcher chose and no others."""
    env = {k: v for k, v in base.items() if k not in (API_KEY_ENV, ADMIN_API_KEY_ENV)}
    env.update(keys.environ())
    return env


# ---- server side --------------------------------------------------------------------------------

def is_admin_path(path: str) -> bool:
    return path.rstrip("/") in ADMIN_PATHS


def is_open_path(path: str) -> bool:
    return path.rstrip("/") in OPEN_PATHS


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>`` (scheme in any case), else
    ``x-api-key: <key>``; ``None`` without either."""
    authorization = headers.get("Authorization")
    if authorization:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def _matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison (the time does not depend on where the keys differ)."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                               expected.encode("ascii"))


def check_request(path: str, headers: Mapping[str, str], keys: Keys
                  ) -> tuple[int, str, str] | None:
    """``None`` if a request for ``path`` with ``headers`` may proceed, else
    ``(status, error type, message)`` of the refusal (messages never contain a key)."""
    if not keys or is_open_path(path):
        return None
    presented = presented_key(headers)
    if is_admin_path(path):
        if keys.admin_api_key:
            if _matches(presented, keys.admin_api_key):
                return None
            return (403, "forbidden", f"{path} changes the server and needs the admin API key "
                    "(Authorization: Bearer <admin key>, or x-api-key)")
        expected = keys.api_key
    else:
        expected = keys.api_key
        if expected is None:  # only an admin key: normal endpoints stay open (as in SGLang)
            return None
    if _matches(presented, expected):
        return None
    what = "a wrong API key was given" if presented else "no API key was given"
    return (401, "unauthorized", f"{path} needs the server's API key ({what}; send "
            "Authorization: Bearer <key>, or x-api-key)")


def aiohttp_middleware(keys: Keys, error_body):
    """An aiohttp middleware enforcing :func:`check_request`; ``error_body(message, type,
    status)`` builds the JSON error. Without keys it passes every request straight through."""
    import json

    from aiohttp import web

    @web.middleware
    async def authenticate(request: web.Request, handler):
        # Judge the endpoint that will run (the route aiohttp matched), whatever the spelling
        # of the request's path; unmatched paths by their own name.
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        refusal = check_request(path, request.headers, keys)
        if refusal is None:
            return await handler(request)
        status, kind, message = refusal
        headers = {"WWW-Authenticate": 'Bearer realm="rl_jax"'} if status == 401 else None
        return web.Response(text=json.dumps(error_body(message, kind, status)), status=status,
                            headers=headers, content_type="application/json")

    return authenticate


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves beyond loopback


def exposure_warning(host: str, keys: Keys) -> str | None:
    """A warning for a server bound beyond loopback without an API key or without an admin
    key (anyone who reaches it could generate, or change its weights); ``None`` otherwise."""
    if is_loopback(host):
        return None
    if not keys:
        return (f"WARNING: serving on {host} without API keys: anyone who can reach this port "
                f"can generate, pause the server or replace its weights. Set {API_KEY_ENV} and "
                f"{ADMIN_API_KEY_ENV} (or --api_key_file / --admin_api_key_file).")
    if not keys.api_key:
        return (f"WARNING: serving on {host} with an admin key only: anyone who can reach this "
                f"port can generate. Set {API_KEY_ENV} (or --api_key_file) too.")
    return None
