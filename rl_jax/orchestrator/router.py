"""An ``sglang-router`` in front of the run's generator servers, through its worker API.

The router (``pip install sglang-router``; 0.3's API) forwards ``/generate`` to its workers
but does not broadcast weight updates, so the run keeps the workers' own URLs for those
(:mod:`rl_jax.orchestrator.fleet`) and sends requests to the router. Its worker API:

    GET    /workers               → {"workers": [{"id", "url", "is_healthy", ...}], ...}
    POST   /workers {"url", "api_key"}   → 202 (added in the background)
    DELETE /workers/{id}          → 202 (removed in the background)

Changes are queued by the router; :meth:`RouterWorkers.add` and :meth:`RouterWorkers.remove`
wait until its list shows them.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rl_jax.generator.auth import NO_KEYS, Keys


class RouterError(RuntimeError):
    """The router refused a call, could not be reached, or did not apply a change in time."""


class RouterWorkers:
    """The worker list of the ``sglang-router`` at ``url``.

    Args:
      url: the router (``http(s)://host:port``).
      keys: the workers' keys: the API key is handed to the router with each worker it adds
        (it forwards requests with it), the admin key authenticates the worker API calls
        (the router's ``--control-plane-api-keys``; none where the router has none).
      timeout_s: most seconds one call, or one change to show in the list, may take.
    """

    def __init__(self, url: str, keys: Keys = NO_KEYS, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.keys, self.timeout_s = keys, timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        key = self.keys.admin_api_key or self.keys.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (OSError, ValueError) as e:
            raise RouterError(f"router {self.url} unreachable ({method} {path}): "
                              f"{type(e).__name__}: {e}") from None
        try:
            return status, json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return status, raw[:300].decode("utf-8", "replace")

    def workers(self) -> dict[str, dict[str, Any]]:
        """url → the router's entry for each worker (``id``, ``is_healthy``, ...)."""
        status, data = self._call("GET", "/workers")
        if status != 200 or not isinstance(data, dict) or not isinstance(
                data.get("workers"), list):
            raise RouterError(f"router {self.url} answered GET /workers with {status}: "
                              f"{str(data)[:300]}")
        return {str(w["url"]).rstrip("/"): w for w in data["workers"]
                if isinstance(w, dict) and isinstance(w.get("url"), str)}

    def healthy(self) -> list[str]:
        return [url for url, w in self.workers().items() if w.get("is_healthy")]

    def add(self, url: str) -> None:
        """Adds the worker ``url`` and waits until the router lists it healthy."""
        body: dict[str, Any] = {"url": url}
        if self.keys.api_key:
            body["api_key"] = self.keys.api_key
        status, data = self._call("POST", "/workers", body)
        if status not in (200, 201, 202):
            raise RouterError(f"router {self.url} refused to add worker {url}: {status} "
                              f"{str(data)[:300]}")
        self._wait(lambda workers: workers.get(url, {}).get("is_healthy"),
                   f"worker {url} to be listed healthy")

    def remove(self, url: str) -> None:
        """Removes the worker ``url`` (nothing when it is not listed) and waits until the
        router no longer lists it."""
        entry = self.workers().get(url)
        if entry is None:
            return
        status, data = self._call("DELETE", f"/workers/{urllib.parse.quote(str(entry['id']))}")
        if status not in (200, 202, 204, 404):
            raise RouterError(f"router {self.url} refused to remove worker {url}: {status} "
                              f"{str(data)[:300]}")
        self._wait(lambda workers: url not in workers, f"worker {url} to be removed")

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done(self.workers()):
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.url}: timed out after {self.timeout_s:.0f} s "
                                  f"waiting for {what}")
            time.sleep(0.05)
