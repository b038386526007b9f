"""Which server is at the other end of the wire, and what it honours.

Every server the client drives reports itself in ``GET /server_info``: real SGLang servers give
their package version (``"version": "0.5.23"``) and their startup settings, this project's
servers ``"version": "rl_jax-<version>"``. :func:`identify` reads that answer:

- an SGLang version outside :data:`SUPPORTED_SGLANG_VERSIONS` is refused
  (:class:`UnsupportedServer`): the protocol moves between SGLang releases (0.5 removed
  ``/get_weight_version`` and added the begin/end weight-update session), so a version the
  project was not tested against fails at start, with the versions it supports, rather than in
  the middle of a run;
- whether a per-request sampling seed is honoured: this project's servers always honour it;
  SGLang only with ``--enable-deterministic-inference`` (otherwise it ignores the seed), which
  the client says once per server when a seeded request goes there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)

# SGLang releases whose HTTP API, weight-update protocol and answers the test suite checks
# (tests/test_sglang_protocol.py runs against a real server of each).
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
OWN_PREFIX = "rl_jax-"


class UnsupportedServer(RuntimeError):
    """A server whose kind or version this project does not speak to."""


@dataclasses.dataclass(frozen=True)
class ServerIdentity:
    kind: str  # "rl_jax" | "sglang"
    version: str
    honours_seed: bool


def identify(info: Any, url: str = "") -> ServerIdentity:
    """The identity in a ``/server_info`` answer; :class:`UnsupportedServer` for an SGLang
    release outside :data:`SUPPORTED_SGLANG_VERSIONS` or an answer naming no version."""
    where = f" at {url}" if url else ""
    version = info.get("version") if isinstance(info, dict) else None
    if not isinstance(version, str) or not version:
        raise UnsupportedServer(f"the generator server{where} reports no version in "
                                f"/server_info ({info!r:.200}); supported: this project's "
                                f"servers and SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)}")
    if version.startswith(OWN_PREFIX):
        return ServerIdentity("rl_jax", version[len(OWN_PREFIX):], honours_seed=True)
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedServer(
            f"the generator server{where} runs SGLang {version}, which this project does not "
            f"support (supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}); install one of "
            f"those in the servers' environment (tools/sglang_cpu/ on CPU)")
    return ServerIdentity("sglang", version,
                          honours_seed=bool(info.get("enable_deterministic_inference")))


def warn_if_seed_ignored(server: Any, body: dict[str, Any]) -> None:
    """Says once per server (a client's ``ServerState``: ``url``, ``identity``, ``seed_warned``)
    that it ignores the sampling seeds of the ``/generate`` ``body`` it is sent."""
    if server.seed_warned or server.identity is None or server.identity.honours_seed:
        return
    params = body.get("sampling_params")
    params = params if isinstance(params, list) else [params]
    if any(isinstance(p, dict) and p.get("sampling_seed") is not None for p in params):
        server.seed_warned = True
        log.warning("generator server %s (SGLang %s) ignores sampling seeds: it runs without "
                    "--enable-deterministic-inference, so seeded requests sample as unseeded "
                    "ones (repeated runs differ)", server.url, server.identity.version)
