"""The publisher's control channel (routes run in the HTTP server's threads).

``GET /v1/info`` (version, transports, host, staging and disk directories), ``POST
/v1/register`` (a layout and the transports its pullers use), ``GET /v1/manifest`` (the newest
version of a layout, long-polled), ``POST /v1/report`` (how a pull went); each transport adds
its own (``Transport.routes``: ``/v1/chunk`` for ``socket``, ``/v1/ticket`` for
``jax_transfer``), served through :meth:`ControlRoutes.offered`. Every input is bounded and
checked; a bad one is answered with 400 naming the field.

:class:`ControlRoutes` is a part of :class:`~rl_jax.transfer.publisher.core.Publisher` (it reads
the publisher's registrations and current version under its lock).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rl_jax.transfer import transports as registry
from rl_jax.transfer.config import MAX_WAIT_S
from rl_jax.transfer.control import MAX_ID_CHARS, HTTPStatus, query_int, query_seconds
from rl_jax.transfer.errors import LayoutError
from rl_jax.transfer.layout import Layout
from rl_jax.transfer.publisher.preparing import Prepared, Registration
from rl_jax.transfer.publisher.staging import HostStaging

MAX_PULLERS = 256  # puller ids remembered per layout (the oldest are forgotten)
# What a pull report may hold: field -> accepted types (others are dropped)
REPORT_FIELDS = {"puller_id": str, "version": int, "transport": str, "ok": bool,
                 "seconds": (int, float), "bytes": int, "error": str, "layout_key": str}
MAX_REPORT_CHARS = 2000  # of one string in a report
MAX_REPORT_BYTES = 16 << 10  # of one report's body


class ControlRoutes:
    """The publisher's control routes (see the module docstring)."""

    def _routes(self) -> tuple[dict, dict[str, int]]:
        """Every route of this publisher, its transports' included (whether enabled or not),
        and the largest body each path accepts."""
        routes = {
            ("GET", "/v1/info"): self._route_info,
            ("POST", "/v1/register"): self._route_register,
            ("GET", "/v1/manifest"): self._route_manifest,
            ("POST", "/v1/report"): self._route_report,
        }
        limits = {"/v1/report": MAX_REPORT_BYTES, "/v1/info": 0, "/v1/manifest": 0}
        for name in registry.names():
            for route, (handler, limit) in registry.get(name).routes(self).items():
                routes[route] = handler
                limits[route[1]] = limit
        return routes, limits

    def add_routes(self, routes: dict, *, token: str | None = None,
                   max_body_bytes: int | None = None) -> None:
        """Serves more routes on this publisher's control server (the run's own, e.g. the
        generator fleet's :mod:`rl_jax.orchestrator.fleet`), with their own ``token`` when
        given (:meth:`~rl_jax.transfer.control.ControlServer.add_routes`)."""
        self._server.add_routes(routes, token=token, max_body_bytes=max_body_bytes)

    def offered(self, key: str, version: int) -> tuple[Prepared, HostStaging | None]:
        """For transports' routes: layout ``key``'s prepared ``version`` (HTTP 410 when that
        version is no longer offered, 409 when the layout was not prepared for it) and the
        layout's host staging (None when it has none), read under the publisher's lock."""
        with self._cond:
            return self._prepared(key, version), self._host.get(key)

    def _route_info(self, query, body):
        with self._cond:
            return {"version": None if self._current is None else self._current.version,
                    "transports": list(self.config.transports), "host_id": self.host_id,
                    "pid": os.getpid(), "layouts": len(self._layouts),
                    "checksum": self.algorithm, "staging_dir": str(self._staging_root),
                    "disk_dir": self.config.disk_dir and str(Path(self.config.disk_dir))}

    def _route_register(self, query, body):
        try:
            layout = Layout.from_json(body["layout"])
        except (KeyError, TypeError, ValueError, AttributeError, LayoutError) as e:
            raise HTTPStatus(400, f"register needs a valid layout: {type(e).__name__}: "
                                  f"{str(e)[:300]}")
        transports, known = body.get("transports"), registry.names()
        if transports is not None and (not isinstance(transports, list) or not all(
                isinstance(t, str) for t in transports) or len(transports) > len(known)):
            raise HTTPStatus(400, f"field 'transports' must be a list of at most "
                                  f"{len(known)} names from {list(known)}")
        puller_id = body.get("puller_id", "")
        if not isinstance(puller_id, str) or len(puller_id) > MAX_ID_CHARS:
            raise HTTPStatus(400, f"field 'puller_id' must be a string of at most "
                                  f"{MAX_ID_CHARS} characters")
        requested = set(transports or self.config.transports)
        usable = requested & set(self.config.transports)
        if not usable:
            raise HTTPStatus(409, f"none of the transports {sorted(requested)} is enabled on "
                                  f"this publisher (enabled: {list(self.config.transports)})")
        key = layout.key
        with self._cond:
            reg = self._layouts.get(key)
            if reg is None:
                self._make_room_for_layout()
                reg = self._layouts[key] = Registration(layout, set(), time.monotonic())
            reg.transports |= usable
            reg.pullers.pop(puller_id, None)
            reg.pullers[puller_id] = None
            while len(reg.pullers) > MAX_PULLERS:
                reg.pullers.pop(next(iter(reg.pullers)))
            reg.last_seen = time.monotonic()
            self._cond.notify_all()
            return {"layout_key": key, "transports": sorted(reg.transports),
                    "version": None if self._current is None else self._current.version}

    def _make_room_for_layout(self) -> None:
        """Caller holds ``self._cond``. Makes room for one more layout under
        ``max_layouts`` by forgetting the idle ones (not seen for ``layout_ttl_s``, so not
        published to any more); 409 when every registered layout is in use."""
        limit = self.config.max_layouts
        if len(self._layouts) < limit:
            return
        now = time.monotonic()
        idle = sorted((r.last_seen, k) for k, r in self._layouts.items()
                      if now - r.last_seen > self.config.layout_ttl_s)
        for _, k in idle[:len(self._layouts) - limit + 1]:
            del self._layouts[k]
        if len(self._layouts) >= limit:
            raise HTTPStatus(409, f"this publisher already serves {len(self._layouts)} layouts "
                                  f"(PublisherConfig.max_layouts={limit}; each costs a copy of "
                                  "the model); pull in one of those layouts or raise the limit",
                             layouts=len(self._layouts))

    def _route_manifest(self, query, body):
        key = query.get("layout", "")
        after = query_int(query, "after", default=-1, minimum=-1)
        deadline = time.monotonic() + query_seconds(query, "wait", default=0.0,
                                                    maximum=MAX_WAIT_S)
        with self._cond:
            while True:
                reg = self._layouts.get(key)
                if reg is None:
                    raise HTTPStatus(404, f"unknown layout {key!r}; register it first")
                reg.last_seen = time.monotonic()
                cur = self._current
                if cur is not None and cur.version > after and key in cur.prepared:
                    prep = cur.prepared[key]
                    if prep.error:
                        raise HTTPStatus(409, prep.error, version=cur.version)
                    return prep.manifest.to_json()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._polling[key] += 1
                try:
                    self._cond.wait(min(remaining, 5.0))
                finally:
                    self._polling[key] -= 1
                    if not self._polling[key]:
                        self._answered.notify_all()

    def _prepared(self, key: str, version: int) -> Prepared:
        """Caller holds ``self._cond``."""
        cur = self._current
        if cur is None or cur.version != version:
            raise HTTPStatus(410, f"version {version} is no longer offered",
                             latest=None if cur is None else cur.version)
        prep = cur.prepared.get(key)
        if prep is None or prep.manifest is None:
            raise HTTPStatus(409, f"layout {key!r} was not prepared for version {version}")
        return prep

    def _route_report(self, query, body):
        """Keeps the known fields of a pull report (strings cut short, others dropped); the
        body's size is bounded by the server, the number of reports kept by ``reports``."""
        report: dict[str, Any] = {"time": time.time()}
        for name, types in REPORT_FIELDS.items():
            value = body.get(name)
            if value is None or not isinstance(value, types) or (
                    isinstance(value, bool) and types is not bool):
                continue
            report[name] = value[:MAX_REPORT_CHARS] if isinstance(value, str) else value
        self.reports.append(report)
        return {"ok": True}
