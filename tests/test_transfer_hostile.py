"""The transfer service against hostile or broken peers and resources, over real loopback
servers, files and processes: unauthenticated requests, too many layouts, oversized bodies,
bad query values, manifests naming paths outside the staging directory, digests that do not
match, a publisher that accepts connections and never answers, and a staging filesystem
too small for a version (a real tmpfs)."""

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_transfer import random_params as params_of, target_of
from transfer_fixtures import LoopbackPeer
from rl_jax.models.config import ModelConfig
from rl_jax.trainer.state import ModelSpec
from rl_jax.transfer.config import PublisherConfig, PullerConfig
from rl_jax.transfer.control import ControlClient, ControlServer, HTTPStatus
from rl_jax.transfer.errors import (AuthenticationError, IntegrityError, PublisherNotAllowed,
                                    PublisherUnavailable, TransferTimeout)
from rl_jax.transfer.layout import Layout, flatten
from rl_jax.transfer.publisher.core import Publisher
from rl_jax.transfer.puller.core import Puller
from rl_jax.transfer.puller.generator import GeneratorPuller, pinned_publisher

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8)
TOKEN = "hostile-tests-token-0123456789"
ENDPOINTS = [("GET", "/v1/info"), ("POST", "/v1/register"), ("GET", "/v1/manifest"),
             ("POST", "/v1/ticket"), ("GET", "/v1/chunk"), ("POST", "/v1/report"),
             ("GET", "/v1/no-such-endpoint")]


@pytest.fixture(scope="module")
def spec():
    return ModelSpec(CONFIG, mesh=None)


def host(params):
    return {n: np.asarray(jax.device_get(v)) for n, v in flatten(params).items()}


@pytest.fixture
def publisher(tmp_path, spec):
    pub = Publisher(PublisherConfig(transports=("shm", "socket", "disk"), auth_token=TOKEN,
                                    staging_dir=str(tmp_path / "staging"),
                                    disk_dir=str(tmp_path / "disk"), chunk_bytes=4096),
                    spec=spec)
    yield pub
    pub.close()


def puller_config(**kw):
    return PullerConfig(auth_token=TOKEN, **kw)


def raw_request(url, method, path, *, body=None, headers=None, token=TOKEN):
    """``(status, decoded JSON)`` of one request sent as given (no client-side checks)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    all_headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    all_headers.update(headers or {})
    try:
        conn.request(method, path, body=body, headers=all_headers)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.getheader("Content-Type") != "application/json":
        return resp.status, data
    return resp.status, (json.loads(data) if data else None)


# ---- authentication ----------------------------------------------------------------------------

def test_every_control_endpoint_refuses_a_missing_or_wrong_token(publisher, spec, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = [None, "", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()]
    for method, path in ENDPOINTS:
        body = b'{"version": 1}' if method == "POST" else None
        for token in wrong:
            status, data = raw_request(publisher.url, method, path + "?layout=x", body=body,
                                       token=token)
            assert status == 401, (method, path, token, status, data)
            assert "token" in data["error"]
        status, data = raw_request(publisher.url, method, path, body=body,
                                   headers={"Authorization": f"Basic {TOKEN}"}, token=None)
        assert status == 401, (method, path)
    # The right token passes authentication (then the route's own checks answer).
    status, info = raw_request(publisher.url, "GET", "/v1/info")
    assert status == 200 and info["transports"] == ["shm", "socket", "disk"]
    assert raw_request(publisher.url, "GET", "/v1/no-such-endpoint")[0] == 404

    # A puller with the wrong token is told so, clearly; with the right one it pulls.
    bad = Puller(publisher.url, target_of(spec), config=PullerConfig(auth_token="nope"))
    with pytest.raises(AuthenticationError, match="refused this puller's token"):
        bad.register()
    good = Puller(publisher.url, target_of(spec), config=puller_config())
    good.register()
    publisher.publish(params_of(spec, 1), 1)
    assert good.pull(0).version == 1
    # The token is never logged, nor shown in the configs' repr.
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(publisher.config) and TOKEN not in repr(good.config)


def test_the_token_comes_from_the_environment_or_is_made_and_exported(tmp_path, spec,
                                                                      monkeypatch):
    monkeypatch.setenv("RL_JAX_TRANSFER_TOKEN", "from-the-environment")
    with Publisher(PublisherConfig(transports=("socket",),
                                   staging_dir=str(tmp_path / "a"))) as pub:
        assert raw_request(pub.url, "GET", "/v1/info", token="from-the-environment")[0] == 200
        assert raw_request(pub.url, "GET", "/v1/info", token=TOKEN)[0] == 401
        Puller(pub.url, target_of(spec)).register()  # reads the environment
    monkeypatch.delenv("RL_JAX_TRANSFER_TOKEN")
    with Publisher(PublisherConfig(transports=("socket",),
                                   staging_dir=str(tmp_path / "b"))) as pub:
        made = os.environ["RL_JAX_TRANSFER_TOKEN"]  # inherited by generators it starts
        assert len(made) >= 32
        assert raw_request(pub.url, "GET", "/v1/info", token=made)[0] == 200
        assert raw_request(pub.url, "GET", "/v1/info", token=None)[0] == 401


# ---- bounds on what one peer can make the publisher do -----------------------------------------

def register_body(spec, dtype=None, **extra):
    return json.dumps({"layout": Layout.from_arrays(target_of(spec, dtype)).to_json(),
                       "transports": ["shm"], "puller_id": "p", **extra}).encode()


def test_layouts_are_limited_and_idle_ones_make_room(tmp_path, spec):
    config = PublisherConfig(transports=("shm",), auth_token=TOKEN, max_layouts=2,
                             layout_ttl_s=1.0, staging_dir=str(tmp_path))
    with Publisher(config) as pub:
        for dtype in (jnp.float32, jnp.bfloat16):
            assert raw_request(pub.url, "POST", "/v1/register",
                               body=register_body(spec, dtype))[0] == 200
        # Registering a known layout again is fine; a third one is refused.
        assert raw_request(pub.url, "POST", "/v1/register",
                           body=register_body(spec, jnp.float32))[0] == 200
        status, data = raw_request(pub.url, "POST", "/v1/register",
                                   body=register_body(spec, jnp.float16))
        assert status == 409 and "max_layouts=2" in data["error"], data
        assert len(pub.layouts()) == 2
        publisher_stats = pub.publish(params_of(spec, 1), 1)  # stages the two layouts
        assert publisher_stats.layouts == 2 and not publisher_stats.errors
        staging = Path(raw_request(pub.url, "GET", "/v1/info")[1]["staging_dir"])
        before = {p.name for p in staging.iterdir() if p.is_dir()}
        assert len(before) == 2
        time.sleep(1.2)  # both idle past layout_ttl_s: one makes room for the new layout
        status, data = raw_request(pub.url, "POST", "/v1/register",
                                   body=register_body(spec, jnp.float16))
        assert status == 200, data
        assert len(pub.layouts()) == 2
        pub.publish(params_of(spec, 2), 2)  # frees the staging of the forgotten layout
        after = {p.name for p in staging.iterdir() if p.is_dir()}
        assert len(before & after) == 1 and set(pub.layouts()) <= after


def test_oversized_and_malformed_bodies_are_refused(publisher, spec):
    url = publisher.url
    big = json.dumps({"puller_id": "p", "error": "x" * (64 << 10)}).encode()
    status, data = raw_request(url, "POST", "/v1/report", body=big)
    assert status == 413 and "exceeds the limit" in data["error"]
    assert not publisher.reports
    # A huge announced body is refused before it is read.
    status, data = raw_request(url, "POST", "/v1/register", body=b"{}",
                               headers={"Content-Length": str(1 << 40)})
    assert status == 413 and str(1 << 40) in data["error"]
    for length in ("-1", "abc", "1e3"):
        status, data = raw_request(url, "POST", "/v1/report", body=b"{}",
                                   headers={"Content-Length": length})
        assert status == 400 and "Content-Length" in data["error"], (length, data)
    status, data = raw_request(url, "POST", "/v1/report", body=b"[1, 2]")
    assert status == 400 and "JSON object" in data["error"]
    status, data = raw_request(url, "POST", "/v1/report", body=b"{not json")
    assert status == 400 and "not valid JSON" in data["error"]
    status, data = raw_request(url, "POST", "/v1/register", body=b"[" * 100000 + b"]" * 100000)
    assert status in (400, 413), data
    # Registration fields are checked, not trusted.
    for extra, field in (({"transports": "shm"}, "transports"),
                         ({"transports": ["shm"] * 50}, "transports"),
                         ({"puller_id": "p" * 1000}, "puller_id"),
                         ({"puller_id": 7}, "puller_id")):
        status, data = raw_request(url, "POST", "/v1/register",
                                   body=register_body(spec, **extra))
        assert status == 400 and field in data["error"], (extra, data)
    status, data = raw_request(url, "POST", "/v1/register", body=b'{"layout": {"specs": 5}}')
    assert status == 400 and "valid layout" in data["error"]
    # A report keeps only the known fields, with strings cut short.
    status, _ = raw_request(url, "POST", "/v1/report", body=json.dumps(
        {"puller_id": "p", "ok": True, "error": "e" * 5000, "junk": [1] * 100,
         "version": "7"}).encode())
    assert status == 200
    report = publisher.reports[-1]
    assert set(report) == {"puller_id", "ok", "error", "time"}
    assert len(report["error"]) == 2000
    assert raw_request(url, "GET", "/v1/info")[0] == 200  # still serving


@pytest.mark.parametrize("query, field", [
    ("after=abc", "after"), ("after=-5", "after"), ("after=1.5", "after"),
    ("after=1e400", "after"), ("after=99999999999999999999999999", "after"),
    ("after=%00", "after"), ("wait=-1", "wait"), ("wait=nan", "wait"), ("wait=inf", "wait"),
    ("wait=1e9", "wait"), ("wait=abc", "wait"), ("wait=" + "9" * 500, "wait")])
def test_bad_manifest_query_values_get_400(publisher, spec, query, field):
    layout = Layout.from_arrays(target_of(spec)).key
    assert raw_request(publisher.url, "POST", "/v1/register", body=register_body(spec))[0] == 200
    status, data = raw_request(publisher.url, "GET", f"/v1/manifest?layout={layout}&{query}")
    assert status == 400 and field in data["error"], (query, status, data)


def test_bad_chunk_and_ticket_values_get_400(publisher, spec):
    puller = Puller(publisher.url, target_of(spec), config=puller_config(),
                    transports=["socket"])
    puller.register()
    publisher.publish(params_of(spec, 1), 1)
    manifest = puller.poll(0)
    chunk = manifest.transports["staging"]["chunks"][0]
    good = {"layout": puller.layout_key, "version": "1", "offset": str(chunk["offset"]),
            "nbytes": str(chunk["nbytes"])}
    assert raw_request(publisher.url, "GET", "/v1/chunk?" + urllib.parse.urlencode(good))[0] \
        == 200
    for field, value in (("version", "x"), ("version", "-3"), ("offset", "-1"),
                         ("offset", "0x10"), ("nbytes", str(1 << 70)), ("nbytes", "")):
        query = urllib.parse.urlencode({**good, field: value})
        status, data = raw_request(publisher.url, "GET", "/v1/chunk?" + query)
        assert status == 400 and field in data["error"], (field, value, status, data)
    for field in ("version", "offset", "nbytes"):
        query = urllib.parse.urlencode({k: v for k, v in good.items() if k != field})
        status, data = raw_request(publisher.url, "GET", "/v1/chunk?" + query)
        assert status == 400 and field in data["error"]
    status, data = raw_request(publisher.url, "GET", "/v1/chunk?" + urllib.parse.urlencode(
        {**good, "nbytes": "10"}))
    assert status == 400 and "no chunk" in data["error"]
    for body in ({"version": "1", "layout_key": puller.layout_key},
                 {"version": True, "layout_key": puller.layout_key},
                 {"version": 1, "layout_key": ["x"]}):
        status, data = raw_request(publisher.url, "POST", "/v1/ticket",
                                   body=json.dumps(body).encode())
        assert status == 400, (body, data)
    assert raw_request(publisher.url, "GET", "/v1/info")[0] == 200


# ---- what a manifest names ---------------------------------------------------------------------

class TamperingPublisher:
    """A real control server in front of a real publisher that forwards every request and
    rewrites the manifests with ``tamper(manifest_json)``."""

    def __init__(self, upstream: Publisher, tamper):
        client = ControlClient(upstream.url, token=TOKEN)

        def forward(method, path):
            def route(query, body):
                status, data = client.request(method, path, query=query or None,
                                              body=body or None)
                if status == 200 and path == "/v1/manifest":
                    data = tamper(data)
                if status == 204:
                    return None
                if status != 200:
                    raise HTTPStatus(status, (data or {}).get("error", ""))
                return data
            return route

        self.server = ControlServer("127.0.0.1", 0, {
            (m, p): forward(m, p) for m, p in ENDPOINTS[:-1] if p != "/v1/chunk"},
            auth_token=TOKEN)
        self.url = self.server.url

    def close(self):
        self.server.close()


def test_manifest_paths_outside_the_staging_directory_are_refused(publisher, spec, tmp_path):
    params = params_of(spec, 1)
    honest = Puller(publisher.url, target_of(spec), config=puller_config(),
                    transports=["shm", "disk"])
    honest.register()
    publisher.publish(params, 1)
    manifest = honest.poll(0)
    real = manifest.transports["shm"]["file"]
    staging = Path(real).parent.parent  # <staging root>/<layout key>/slotN.safetensors
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(real, outside / "slot.safetensors")  # a byte-identical copy elsewhere
    link = staging / "escape.safetensors"
    link.symlink_to(outside / "slot.safetensors")
    disk_copy = tmp_path / "elsewhere"
    shutil.copytree(manifest.transports["disk"]["path"], disk_copy)
    cases = {
        "elsewhere": ("shm", "file", str(outside / "slot.safetensors")),
        "dotdot": ("shm", "file", f"{staging}/../outside/slot.safetensors"),
        "relative dotdot": ("shm", "file", "../../outside/slot.safetensors"),
        "symlink out": ("shm", "file", str(link)),
        "stamp": ("shm", "stamp", "/etc/passwd"),
        "root itself": ("shm", "file", str(staging)),
        "not a path": ("shm", "file", 12),
        "disk elsewhere": ("disk", "path", str(disk_copy)),
        "disk dotdot": ("disk", "path", manifest.transports["disk"]["path"] + "/../../elsewhere"),
    }
    for name, (transport, key, value) in cases.items():
        def tamper(data, transport=transport, key=key, value=value):
            data["transports"][transport][key] = value
            return data

        proxy = TamperingPublisher(publisher, tamper)
        try:
            puller = Puller(proxy.url, target_of(spec), config=puller_config(),
                            transports=[transport])
            with pytest.raises(IntegrityError, match="refused|must be a path") as e:
                puller.pull(0)
            assert "outside" in str(e.value) or ".." in str(e.value) \
                or "must be a path" in str(e.value), (name, e.value)
        finally:
            proxy.close()
    # The untampered manifest through the same proxy pulls fine.
    proxy = TamperingPublisher(publisher, lambda data: data)
    try:
        for transport in ("shm", "disk"):
            update = Puller(proxy.url, target_of(spec), config=puller_config(),
                            transports=[transport]).pull(0)
            got, want = host(update.params), host(params)
            assert all(np.array_equal(got[n], want[n]) for n in want)
    finally:
        proxy.close()


def test_manifests_going_backwards_or_out_of_bounds_are_refused(publisher, spec):
    def older(data):
        data["version"] = 3
        return data

    def outside(data):
        data["tensors"][0]["shards"][0]["offset"] = 1 << 40
        return data

    for version, (tamper, message) in enumerate((
            (older, "version 3 when asked for one newer than 4"), (outside, "lies outside")),
            start=5):
        proxy = TamperingPublisher(publisher, tamper)
        try:
            puller = Puller(proxy.url, target_of(spec), config=puller_config(),
                            transports=["socket"])
            puller.register()
            publisher.publish(params_of(spec, version), version)
            with pytest.raises(IntegrityError, match=message):
                puller.pull(4)
        finally:
            proxy.close()


# ---- digests -----------------------------------------------------------------------------------

def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("transport", ["shm", "socket", "disk"])
def test_data_that_does_not_match_its_digests_is_refused(publisher, spec, transport):
    """The staged bytes (or the checkpoint on disk) change after the publisher hashed them:
    every transport's pull is refused naming the tensor, and pulls again once intact."""
    puller = Puller(publisher.url, target_of(spec), config=puller_config(),
                    transports=["shm", "socket", "disk"])  # not streamed: hashed at the end
    puller.register()
    params = params_of(spec, 1)
    publisher.publish(params, 1)
    manifest = puller.poll(0)
    tensor = manifest.tensor("layers.wq")
    if transport == "disk":
        from safetensors import safe_open
        path = Path(manifest.transports["disk"]["path"])
        file = sorted(path.glob("*.safetensors"))[0]
        with safe_open(str(file), "np") as f:
            name = next(k for k in f.keys() if "q_proj" in k)
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        offset = 8 + n + header[name]["data_offsets"][0] + 4
        file_path = file
    else:
        file_path = manifest.transports["shm"]["file"]
        offset = tensor.shards[0].offset + 4
    flip_byte(file_path, offset)
    with pytest.raises(IntegrityError, match=r"refused.*checksum mismatch"):
        puller.pull(0, transport=transport)
    flip_byte(file_path, offset)
    update = puller.pull(0, transport=transport)
    got, want = host(update.params), host(params)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_a_manifest_with_an_unknown_checksum_is_refused(publisher, spec):
    def tamper(data):
        data["checksum"] = "none"
        return data

    proxy = TamperingPublisher(publisher, tamper)
    try:
        puller = Puller(proxy.url, target_of(spec), config=puller_config(),
                        transports=["socket"])
        puller.register()
        publisher.publish(params_of(spec, 1), 1)
        with pytest.raises(IntegrityError, match="names checksum 'none'"):
            puller.pull(0)
    finally:
        proxy.close()


# ---- pinning and deadlines ---------------------------------------------------------------------

def test_a_generator_pulls_only_from_its_publisher():
    mine = "http://127.0.0.1:4000"
    assert pinned_publisher(None, mine) == mine
    assert pinned_publisher("127.0.0.1:4000", mine) == mine
    assert pinned_publisher("HTTP://127.0.0.1:4000/", mine) == mine
    for other in ("http://127.0.0.1:4001", "http://10.0.0.5:4000", "127.0.0.2:4000"):
        with pytest.raises(PublisherNotAllowed, match="pulls only from its publisher"):
            pinned_publisher(other, mine)
    with pytest.raises(PublisherNotAllowed, match="started without a publisher"):
        pinned_publisher("http://127.0.0.1:4001", None)
    for bad in ("x", "http://127.0.0.1", "ftp://h:1", "http://u:p@h:1", "http://h:1/path", 5):
        with pytest.raises(ValueError, match="HOST:PORT"):
            pinned_publisher(bad, mine)
    with pytest.raises(ValueError, match="required"):
        pinned_publisher(None, None)


class StalledPublisher:
    """A listening socket that accepts every connection and never answers (nor closes)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.accepted:
            conn.close()


class FakeEngine:
    def __init__(self, params):
        self.params, self.version = params, 0


def test_a_stalled_publisher_releases_the_pull_within_its_deadline(spec):
    stalled = StalledPublisher()
    engine = FakeEngine(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), target_of(spec)))
    try:
        gp = GeneratorPuller(stalled.url, config=puller_config(timeout_s=1.5))
        for wait_s in (0.0, 1.0):
            start = time.monotonic()
            with pytest.raises(TransferTimeout) as e:
                gp.pull_latest(engine, wait_s=wait_s)
            took = time.monotonic() - start
            assert 1.5 + wait_s - 0.2 <= took <= 1.5 + wait_s + 1.0, took
            assert stalled.url.split("//")[1] in str(e.value)
        assert stalled.accepted  # it did connect: the publisher just never answered
        assert engine.version == 0
        # The pull's lock was released each time: pulls from two threads both end in time.
        results = []

        def pull():
            try:
                gp.pull_latest(engine)
            except TransferTimeout as e:
                results.append(e)

        start = time.monotonic()
        threads = [threading.Thread(target=pull) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 2 and time.monotonic() - start <= 2 * 1.5 + 1.5
    finally:
        stalled.close()


@pytest.mark.parametrize("timeout_s,http_timeout_s", [(2.0, 5.0), (5.0, 2.0)])
def test_a_publisher_trickling_its_answer_cannot_stretch_the_deadline(spec, timeout_s,
                                                                      http_timeout_s):
    """One byte of the status line and headers every 0.3 s, for ever: the pull still ends at
    its deadline, or at the request's own bound (``http_timeout_s`` covers a whole request)
    if that comes first, although no single read waits longer than the socket timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = server.accept()
        conn.recv(65536)
        with conn:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10000:
                if stop.wait(0.3):
                    return
                conn.sendall(bytes([byte]))

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    engine = FakeEngine(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), target_of(spec)))
    gp = GeneratorPuller(url, config=puller_config(timeout_s=timeout_s,
                                                   http_timeout_s=http_timeout_s))
    start = time.monotonic()
    try:
        with pytest.raises(TransferTimeout, match="deadline"):
            gp.pull_latest(engine)
        assert 1.8 <= time.monotonic() - start <= 3.0
    finally:
        stop.set()
        server.close()


# ---- whatever answers at the publisher's address -----------------------------------------------

class AnsweringPeer(LoopbackPeer):
    """A loopback peer that answers every request with ``head`` and then ``body_bytes`` bytes
    of ``b"x"`` (counted in :attr:`sent` as they go out), or with ``head`` alone when
    ``body_bytes`` is 0; it stops sending once the other side hangs up."""

    def __init__(self, head: bytes, body_bytes: int = 0):
        self.head, self.body_bytes, self.sent = head, body_bytes, 0
        super().__init__()

    def serve(self, conn):
        piece = b"x" * (64 << 10)
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(self.head)
                left = self.body_bytes
                while left > 0:
                    n = conn.send(piece[:left])
                    self.sent += n
                    left -= n
            except OSError:
                return


def test_an_oversized_answer_is_refused_unread(spec):
    """A 200 MB answer, announced or not, is refused at the answer cap
    (``PullerConfig.max_answer_bytes``, 16 MiB by default): it is not read into memory, and
    the error says what it was (status, size, content type)."""
    import tracemalloc
    big = 200 << 20
    announced = AnsweringPeer(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % big, big)
    unannounced = AnsweringPeer(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\n\r\n", big)
    try:
        for peer, words in ((announced, f"{big} bytes of 'application/json'"),
                            (unannounced, f"more than {16 << 20} bytes")):
            tracemalloc.start()
            try:
                with pytest.raises(PublisherUnavailable, match="max_answer_bytes") as e:
                    Puller(peer.url, target_of(spec), config=puller_config()).register()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert words in str(e.value) and "200" in str(e.value), e.value
            assert peak < 40 << 20, peak  # at most the cap read, never the answer
            assert peer.sent < 48 << 20, peer.sent  # the puller hung up
        # The cap is a setting.
        small = AnsweringPeer(json_answer_bytes({"transports": ["socket"] * 1000,
                                                 "host_id": "h"}))
        try:
            with pytest.raises(PublisherUnavailable, match="more than the 4096 bytes"):
                Puller(small.url, target_of(spec),
                       config=puller_config(max_answer_bytes=4096)).register()
        finally:
            small.close()
    finally:
        announced.close()
        unannounced.close()


def json_answer_bytes(data, status: str = "200 OK", content_type="application/json") -> bytes:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: "
            f"{len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw


SECRET = "internal-answer-secret-0123456789"


@pytest.mark.parametrize("answer,words", [
    (json_answer_bytes(f"<html>{SECRET}</html>".encode(), content_type="text/html"),
     "200 with 46 bytes of 'text/html', not JSON"),
    (json_answer_bytes(f"{SECRET} oops".encode(), "500 Oops", "text/plain"),
     "500 with 38 bytes of 'text/plain', not JSON"),
    (json_answer_bytes(f'{{"a": "{SECRET}"'.encode()), "does not parse as JSON"),
    (json_answer_bytes(b"[" * 100_000 + b"]" * 100_000), "does not parse as JSON"),
    (json_answer_bytes([SECRET]), "200 and list, not an object"),
    (json_answer_bytes({"transports": SECRET, "host_id": SECRET}),
     "without a list of transports and a host_id: not a publisher"),
    (json_answer_bytes({"detail": SECRET}, "502 Bad Gateway"), "failed (GET /v1/info): 502"),
])
def test_a_peer_that_is_no_publisher_is_described_not_echoed(spec, answer, words):
    """Whatever answers at the publisher's address: the puller's error says what the answer
    was (status, size, content type) and never repeats its content."""
    peer = AnsweringPeer(answer)
    try:
        with pytest.raises(PublisherUnavailable) as e:
            Puller(peer.url, target_of(spec), config=puller_config()).register()
        assert words in str(e.value), e.value
        assert SECRET not in str(e.value) and "html" not in str(e.value).replace(
            "'text/html'", ""), e.value
    finally:
        peer.close()


class TricklingProxy(LoopbackPeer):
    """A raw HTTP proxy in front of a real publisher: every answer is forwarded, those to
    ``/v1/chunk`` one byte every 0.2 s (for as long as the puller keeps reading)."""

    def __init__(self, upstream: str):
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        super().__init__()

    def serve(self, conn):
        reader = conn.makefile("rb")
        with conn, reader:
            while not self._stop.is_set():
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, value = line.decode().split(":", 1)
                    headers[name.strip()] = value.strip()
                body = reader.read(int(headers.get("Content-Length", 0))) or None
                up = http.client.HTTPConnection(*self.upstream, timeout=30)
                up.request(method, path, body=body, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                up.close()
                answer = (f"HTTP/1.1 {resp.status} {resp.reason}\r\nContent-Type: "
                          f"{resp.getheader('Content-Type')}\r\nContent-Length: "
                          f"{len(data)}\r\n\r\n").encode() + data
                try:
                    if not path.startswith("/v1/chunk"):
                        conn.sendall(answer)
                        continue
                    for i in range(len(answer)):
                        if self._stop.wait(0.2):
                            return
                        conn.sendall(answer[i:i + 1])
                except OSError:  # the puller hung up
                    return


def test_a_trickled_chunk_is_cut_at_the_deadline_of_the_whole_pull(publisher, spec):
    """The socket transport's chunks come one byte every 0.2 s: every read gets its byte
    well within the socket timeout, yet the pull ends at its deadline and so do its chunk
    readers (none keeps reading, or holds a connection, after the pull gave up)."""
    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("transfer-socket")
                and t.is_alive()]

    proxy = TricklingProxy(publisher.url)
    try:
        puller = Puller(proxy.url, target_of(spec), transports=["socket"],
                        config=puller_config(timeout_s=2.0, http_timeout_s=1.0))
        puller.register()
        publisher.publish(params_of(spec, 1), 1)
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            puller.pull(0)
        assert time.monotonic() - start <= 3.0
        deadline = time.monotonic() + 2.0
        while readers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not readers(), readers()
    finally:
        proxy.close()


# ---- running out of staging space --------------------------------------------------------------

SPACE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from transfer_fixtures import CONFIG, make_params
    from rl_jax.trainer.state import ModelSpec
    from rl_jax.transfer.config import PublisherConfig, PullerConfig
    from rl_jax.transfer.errors import TransferError
    from rl_jax.transfer.publisher.core import Publisher
    from rl_jax.transfer.puller.core import Puller
    from rl_jax.transfer.layout import flatten
    import jax

    staging, disk, transports = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(","))
    spec = ModelSpec(CONFIG, mesh=None)
    params = make_params(spec, 0)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          spec.abstract_params, spec.param_shardings)
    pub = Publisher(PublisherConfig(transports=transports, staging_dir=staging,
                                    disk_dir=disk if "disk" in transports else None,
                                    auth_token="t"), spec=spec)
    puller = Puller(pub.url, target, config=PullerConfig(auth_token="t"))  # registers for shm
    puller.register()
    out = {"nbytes": sum(int(np.asarray(v).nbytes) for v in flatten(params).values())}
    stats = pub.publish(params, 1)
    out["errors"] = list(stats.errors.values())
    try:
        update = puller.pull(0)
        got = {n: np.asarray(v) for n, v in flatten(update.params).items()}
        want = {n: np.asarray(v) for n, v in flatten(params).items()}
        out["pulled"] = update.metrics.transport
        out["equal"] = all(np.array_equal(got[n], want[n]) for n in want)
    except TransferError as e:
        out["pull_error"] = f"{type(e).__name__}: {e}"
    pub.close()
    print("@@" + json.dumps(out))
""")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root, as in CI); unmounted afterwards."""
    path = tmp_path / "tmpfs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def run_space_script(staging, disk, transports):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", SPACE_SCRIPT, str(staging), str(disk),
                           ",".join(transports)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, (f"the publishing process died (returncode "
                                  f"{done.returncode}; -7 is SIGBUS):\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("@@"))
    return json.loads(line[2:]), done.stderr


def test_full_staging_is_a_clear_error_not_a_crash(small_tmpfs, tmp_path):
    out, log = run_space_script(small_tmpfs, tmp_path / "disk", ["shm"])
    assert out["nbytes"] > 1 << 20  # the version does not fit in the tmpfs
    assert len(out["errors"]) == 1
    assert str(small_tmpfs) in out["errors"][0] and "bytes free" in out["errors"][0]
    assert "LayoutError" in out["pull_error"] and "bytes free" in out["pull_error"]
    assert "Traceback" not in log


def test_full_staging_falls_back_to_the_disk_transport(small_tmpfs, tmp_path):
    out, log = run_space_script(small_tmpfs, tmp_path / "disk", ["shm", "disk"])
    assert out["errors"] == [], out
    assert out["pulled"] == "disk" and out["equal"] is True, out
    assert "offering version 1 over ['disk'] instead" in log
