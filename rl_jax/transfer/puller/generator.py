"""The generator server's side of weight transfer: which publisher it may pull from, and a
:class:`GeneratorPuller` that pulls verified versions for its engine (on request or in a
background loop) and keeps the counters the server reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rl_jax.transfer import transports as registry
from rl_jax.transfer.config import MAX_WAIT_S, PullerConfig
from rl_jax.transfer.control import normalize_url
from rl_jax.transfer.errors import PublisherNotAllowed, TransferError, TransferTimeout
from rl_jax.transfer.layout import Layout
from rl_jax.transfer.puller.core import Puller, PullMetrics, WeightUpdate

log = logging.getLogger(__name__)


def pinned_publisher(requested: str | None, configured: str | None) -> str:
    """The publisher a generator may pull from when a request names ``requested`` (None:
    the ``configured`` one, the generator's own): that one only.

    The transfer token (``$RL_JAX_TRANSFER_TOKEN``) is a credential for the publisher the
    generator was started with; binding every pull to that publisher keeps it from being sent
    anywhere else, and keeps a request from making the generator connect to an address of its
    caller's choosing. A pull from another publisher without the token could not succeed (every
    publisher requires one), so it is refused before any connection.

    Addresses are compared as ``http://host:port`` (lower-case host). Raises
    :class:`PublisherNotAllowed` for another publisher, ``ValueError`` for a malformed address
    or when neither is given."""
    if requested in (None, ""):
        if not configured:
            raise ValueError("publisher_url is required (this generator was started without "
                             "one)")
        return configured
    url = normalize_url(requested)
    if configured and url == normalize_url(configured):
        return configured  # as configured: the generator keeps one puller per publisher
    if not configured:
        raise PublisherNotAllowed(f"this generator was started without a publisher and may "
                                  f"not pull from {url}: its transfer token is sent only to the "
                                  f"publisher it is started with (--publisher_url={url})")
    raise PublisherNotAllowed(f"this generator pulls only from its publisher "
                              f"{normalize_url(configured)}, not {url}: its transfer token is "
                              "bound to the publisher it was started with (--publisher_url)")


class GeneratorPuller:
    """The generator server's integration surface: pulls for an :class:`Engine`.

    ``pull_latest(engine)`` pauses nothing and changes nothing: it returns a verified
    :class:`WeightUpdate` in the engine's live shardings and dtypes (or None when the publisher
    has nothing newer than ``engine.version``); the server then calls
    ``engine.update_weights(update.params, update.version, finite_checked=...)``, which swaps
    between two decode steps. :meth:`start` runs that loop in a background thread instead.
    """

    def __init__(self, url: str, *, config: PullerConfig | None = None,
                 puller_id: str | None = None, transports: Sequence[str] | None = None):
        self.url, self.config = url, PullerConfig() if config is None else config
        self.puller_id, self.transports = puller_id, transports
        self._puller: Puller | None = None
        self._lock = threading.Lock()
        self.last: PullMetrics | None = None
        self.counters = {"updates": 0, "failures": 0, "versions_skipped": 0, "bytes": 0}
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def puller(self, params: Mapping[str, Any]) -> Puller:
        """The :class:`Puller` for ``params``'s layout (rebuilt if the layout changed)."""
        key = Layout.from_arrays(params).key
        if self._puller is None or self._puller.layout_key != key:
            self._puller = Puller(self.url, params, config=self.config,
                                  puller_id=self.puller_id, transports=self.transports)
        return self._puller

    def pull_latest(self, engine: Any, *, wait_s: float = 0.0, min_version: int | None = None,
                    transport: str | None = None) -> WeightUpdate | None:
        """Pulls the newest version newer than ``engine.version`` (and at least
        ``min_version``), waiting up to ``wait_s`` for one. Raises ``TransferError`` on
        failure; the engine is untouched either way.

        Returns or raises within about ``config.timeout_s + wait_s`` (``wait_s`` at most
        ``MAX_WAIT_S``) whatever the publisher does (see :meth:`Puller.pull`: every request
        and wait of the pull ends at its deadline; a stalled publisher gives
        :class:`TransferTimeout`), so a caller holding a lock around this call holds it for a
        bounded time."""
        wait_s = min(max(float(wait_s), 0.0), MAX_WAIT_S)
        bound = self.config.timeout_s + wait_s
        if transport is not None:
            registry.get(transport)  # an unknown name is an error naming the known ones
        if not self._lock.acquire(timeout=bound):
            raise TransferTimeout(f"another pull from {self.url} still runs after {bound:.1f} s")
        try:
            if transport is not None and transport not in (self.transports or ()):
                # Asked for a transport it did not register: registers again with it (the
                # next pull makes the new registration).
                self.transports, self._puller = [transport], None
            current = int(engine.version)
            after = current if min_version is None else max(current, int(min_version) - 1)
            try:
                update = self.puller(engine.params).pull(after, wait_s=wait_s, current=current,
                                                         transport=transport)
            except TransferError as e:
                self.counters["failures"] += 1
                self.last_error = str(e)
                raise
            if update is not None:
                self.last = update.metrics
                self.counters["updates"] += 1
                self.counters["versions_skipped"] += update.metrics.versions_skipped
                self.counters["bytes"] += update.metrics.bytes
            return update
        finally:
            self._lock.release()

    def run(self, engine: Any, stop: threading.Event, wait_s: float = 30.0,
            backoff_s: float = 1.0) -> None:
        """Long-polls and applies every new version until ``stop`` is set."""
        while not stop.is_set():
            try:
                update = self.pull_latest(engine, wait_s=wait_s)
            except TransferError as e:
                log.warning("weight pull failed (keeping version %s): %s", engine.version, e)
                stop.wait(backoff_s)
                continue
            if update is not None:
                try:
                    engine.update_weights(update.params, update.version,
                                          finite_checked=update.finite_checked)
                except (ValueError, RuntimeError) as e:  # e.g. the engine's WeightsRefused
                    # A version the engine refuses (non-finite values, an older version) is
                    # skipped: the engine keeps serving what it has and the next one is pulled.
                    log.warning("weight version %s refused (keeping version %s): %s",
                                update.version, engine.version, e)
                    stop.wait(backoff_s)

    def start(self, engine: Any, wait_s: float = 30.0) -> threading.Thread:
        """:meth:`run` in a daemon thread (stop it with :meth:`stop`)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(engine, self._stop, wait_s),
                                        name="transfer-puller", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "last": None if self.last is None else self.last.to_json(),
                "last_error": self.last_error}
