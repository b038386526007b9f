"""API keys on the generator servers (SGLang's --api-key / --admin-api-key scheme): the decision
table, key loading, the launcher's hand-over (environment or a private file, never a command
line), real keyed server processes refusing every endpoint without the right key, the client
and pool generating through them, and SGLang's router in front of keyed servers."""

import asyncio
import importlib.util
import itertools
import json
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from generator_fixtures import http, server_env, write_checkpoints
from rl_jax.generator import auth
from rl_jax.generator.auth import (ADMIN_API_KEY_ENV, API_KEY_ENV, AuthConfigError, Keys,
                                   check_request, exposure_warning, load_keys, presented_key)
from rl_jax.generator.client.control import GeneratorRequestError
from rl_jax.generator.client.core import GeneratorClient
from rl_jax.generator.launcher.pool import (LaunchError, PoolConfig, ServerPool, free_port,
                                            server_command)
from rl_jax.generator.types import GenerateRequest, SamplingParams

API, ADMIN = "api-key-0123456789abcdef", "admin-key-fedcba9876543210"
WRONG = "api-key-0123456789abcdeX"  # differs from API in its last character only

# Every endpoint of rl_jax.generator.server.app: (method, path, a body that passes validation).
ADMIN_ENDPOINTS = [
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("POST", "/flush_cache", {}),
    ("GET", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", "CHECKPOINT"),
    ("POST", "/update_weights_from_transfer", {"publisher_url": "http://127.0.0.1:9"}),
    # SGLang's broadcast protocol; with the admin key the last three are refused for what they
    # ask (no such group, a backend this server lacks, a bucket of an unknown group), not
    # for the key
    ("POST", "/begin_weight_update", {}),
    ("POST", "/end_weight_update", {}),
    ("POST", "/destroy_weights_update_group", {"group_name": "nobody"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 9,
                                            "rank_offset": 1, "world_size": 2,
                                            "group_name": "g", "backend": "nccl"}),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                  "group_name": "g"}),
]
REFUSED_FOR_WHAT_THEY_ASK = {"/destroy_weights_update_group", "/init_weights_update_group",
                             "/update_weights_from_distributed"}
NORMAL_ENDPOINTS = [
    ("POST", "/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}),
    ("PUT", "/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}),
    ("GET", "/get_model_info", None), ("GET", "/model_info", None),
    ("GET", "/get_server_info", None), ("GET", "/server_info", None),
    ("GET", "/get_load", None), ("GET", "/get_weight_version", None), ("GET", "/v1/models", None),
]
OPEN_ENDPOINTS = [("GET", "/health", None), ("GET", "/health_generate", None)]


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


# ---- the decision table -------------------------------------------------------------------------

@pytest.mark.parametrize("keys, path, presented, expected", [
    # no keys: everything open
    (Keys(), "/generate", None, None), (Keys(), "/pause_generation", None, None),
    # API key only: it guards every endpoint, admin ones included (SGLang's ADMIN_OPTIONAL)
    (Keys(API), "/generate", None, 401), (Keys(API), "/generate", WRONG, 401),
    (Keys(API), "/generate", API, None), (Keys(API), "/pause_generation", None, 401),
    (Keys(API), "/pause_generation", API, None), (Keys(API), "/health", None, None),
    # admin key only: normal endpoints open, admin endpoints need the admin key
    (Keys(None, ADMIN), "/generate", None, None), (Keys(None, ADMIN), "/flush_cache", None, 403),
    (Keys(None, ADMIN), "/flush_cache", API, 403), (Keys(None, ADMIN), "/flush_cache", ADMIN, None),
    # both: the API key for normal endpoints (only it), the admin key for admin ones (only it)
    (Keys(API, ADMIN), "/generate", API, None), (Keys(API, ADMIN), "/generate", ADMIN, 401),
    (Keys(API, ADMIN), "/generate", None, 401), (Keys(API, ADMIN), "/abort_request", API, 403),
    (Keys(API, ADMIN), "/abort_request", None, 403),
    (Keys(API, ADMIN), "/abort_request", WRONG, 403),
    (Keys(API, ADMIN), "/update_weights_from_transfer", ADMIN, None),
    (Keys(API, ADMIN), "/update_weights_from_disk/", API, 403),  # a trailing slash changes nothing
    (Keys(API, ADMIN), "/health", None, None), (Keys(API, ADMIN), "/health_generate", None, None),
    (Keys(API, ADMIN), "/metrics", None, None),
    (Keys(API, ADMIN), "/no_such_endpoint", None, 401),  # no key: no map of the endpoints
])
def test_who_may_call_what(keys, path, presented, expected):
    headers = bearer(presented) if presented else {}
    refusal = check_request(path, headers, keys)
    assert (refusal and refusal[0]) == expected
    if refusal:
        assert API not in refusal[2] and ADMIN not in refusal[2] and path in refusal[2]


def test_both_header_forms_and_their_variants():
    assert presented_key({"Authorization": f"Bearer {API}"}) == API
    assert presented_key({"Authorization": f"bearer  {API} "}) == API
    assert presented_key({"x-api-key": API}) == API
    assert presented_key({"Authorization": f"Basic {API}", "x-api-key": ADMIN}) == ADMIN
    assert presented_key({"Authorization": "Bearer "}) is None
    assert presented_key({"Authorization": API}) is None  # no scheme
    assert presented_key({}) is None
    keys = Keys(API, ADMIN)
    assert check_request("/generate", {"x-api-key": API}, keys) is None
    assert check_request("/pause_generation", {"x-api-key": ADMIN}, keys) is None
    assert check_request("/generate", {"x-api-key": "\u00e9" + API}, keys)[0] == 401  # not ASCII


def test_keys_never_show_in_reprs_or_configs(tmp_path):
    from rl_jax.generator.server.config import ServerConfig
    keys = Keys(API, ADMIN)
    for text in (repr(keys), str(keys), f"{keys}", repr(ServerConfig(model="m", keys=keys)),
                 repr(PoolConfig(model="m", keys=keys))):
        assert API not in text and ADMIN not in text, text
    assert repr(keys) == "Keys(api_key=set, admin_api_key=set)"
    assert pickle.loads(pickle.dumps(keys)) == keys  # crosses process boundaries intact
    with pytest.raises(AttributeError):
        keys.api_key = "x"
    assert not Keys() and Keys(API) and Keys(None, ADMIN)


def test_where_keys_come_from(tmp_path):
    env = {API_KEY_ENV: "from-env", ADMIN_API_KEY_ENV: "admin-from-env"}
    assert load_keys(environ={}) == Keys()
    assert load_keys(environ=env) == Keys("from-env", "admin-from-env")
    assert load_keys(environ={API_KEY_ENV: ""}) == Keys()  # an empty variable is no key
    (tmp_path / "api").write_text(API + "\n")
    (tmp_path / "admin").write_text(ADMIN)
    # a flag beats a file, a file beats the environment
    assert load_keys("from-flag", environ=env).api_key == "from-flag"
    assert load_keys(api_key_file=tmp_path / "api", admin_api_key_file=tmp_path / "admin",
                     environ=env) == Keys(API, ADMIN)
    with pytest.raises(AuthConfigError, match="give api_key or api_key_file, not both"):
        load_keys("x", tmp_path / "api", environ={})


@pytest.mark.parametrize("content, message", [
    (None, "api_key_file file '.*missing' cannot be read: FileNotFoundError"),
    ("\n  \n", "api_key_file file '.*missing' is empty"),
    ("two words", "must be printable ASCII without spaces"),
    ("caf\u00e9", "cannot be read: UnicodeDecodeError"),
])
def test_unusable_key_files_are_refused_by_name(tmp_path, content, message):
    path = tmp_path / "missing"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(AuthConfigError, match=message) as e:
        load_keys(api_key_file=path, environ={})
    if content and content.strip():
        assert content.strip() not in str(e.value)


def test_bad_keys_are_refused_without_echoing_them():
    for bad in ("", "has space", "tab\tkey", "caf\u00e9"):
        with pytest.raises(AuthConfigError) as e:
            Keys(bad)
        assert "api_key" in str(e.value) and (not bad or bad not in str(e.value))
    with pytest.raises(AuthConfigError, match="environment variable RL_JAX_ADMIN_API_KEY"):
        load_keys(environ={ADMIN_API_KEY_ENV: "new\nline"})


def test_exposure_warning():
    for host in ("127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]"):
        assert exposure_warning(host, Keys()) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "gen0.example"):
        assert "without API keys" in exposure_warning(host, Keys())
        assert exposure_warning(host, Keys(API, ADMIN)) is None
        assert exposure_warning(host, Keys(API)) is None
        assert "admin key only" in exposure_warning(host, Keys(None, ADMIN))


def test_every_server_endpoint_is_classified():
    """A new endpoint must be named admin, open or normal here: every route that changes the
    server is an admin path."""
    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig
    from rl_jax.generator.server.distributed_endpoints import DistributedWeightEndpoints
    fake = GeneratorServer.__new__(GeneratorServer)
    fake.config, fake.http_requests = ServerConfig(model="m", keys=Keys(API, ADMIN)), {}
    fake.distributed = DistributedWeightEndpoints(fake)
    routes = {(r.method, r.resource.canonical) for r in fake.app().router.routes()}
    listed = {(m, p) for m, p, _ in ADMIN_ENDPOINTS + NORMAL_ENDPOINTS + OPEN_ENDPOINTS}
    assert routes == listed
    for method, path in routes:
        assert auth.is_admin_path(path) == ((method, path) in
                                            {(m, p) for m, p, _ in ADMIN_ENDPOINTS})
        if method in ("POST", "PUT") and path != "/generate":
            assert auth.is_admin_path(path), path


# ---- the launcher -------------------------------------------------------------------------------

def test_launcher_hands_keys_over_by_environment_not_argv(tmp_path, monkeypatch):
    keys = Keys(API, ADMIN)
    monkeypatch.setenv(API_KEY_ENV, "inherited")  # the pool's keys replace inherited ones
    pool = ServerPool(PoolConfig(model="m", ports=(1, 2), keys=keys, log_dir=str(tmp_path)))
    for cmd in pool.commands():
        assert not any(API in a or ADMIN in a for a in cmd), cmd
    assert pool.env[API_KEY_ENV] == API and pool.env[ADMIN_API_KEY_ENV] == ADMIN
    unkeyed = ServerPool(PoolConfig(model="m", log_dir=str(tmp_path)))
    assert API_KEY_ENV not in unkeyed.env and ADMIN_API_KEY_ENV not in unkeyed.env


def test_launcher_gives_sglang_its_keys_in_a_private_config_file(tmp_path):
    pool = ServerPool(PoolConfig(model="m", kind="sglang", ports=(30001, 30002),
                                 keys=Keys(API, ADMIN), log_dir=str(tmp_path)))
    commands = pool.commands()
    files = set()
    for cmd in commands:
        assert not any(API in a or ADMIN in a for a in cmd), cmd
        files.add(cmd[cmd.index("--config") + 1])
    (path,) = files
    path = Path(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # SGLang's own setting names (its --config YAML; JSON strings are YAML scalars)
    settings = dict(line.split(": ", 1) for line in path.read_text().splitlines())
    assert {k: json.loads(v) for k, v in settings.items()} == {"api-key": API,
                                                               "admin-api-key": ADMIN}
    pool.stop()
    assert not path.exists()
    plain = server_command(PoolConfig(model="m", kind="sglang"), 30001)
    assert "--config" not in plain


@pytest.mark.parametrize("field, value, message", [
    ("env", ((API_KEY_ENV, "x"),), "give the servers' keys as PoolConfig.keys"),
    ("extra_args", ("--api-key", "x"), "extra_args name --api-key"),
    ("extra_args", ("--admin_api_key=x",), "extra_args name --admin_api_key"),
    ("keys", API, "keys must be rl_jax.generator.auth.Keys, got str"),
])
def test_launcher_refuses_keys_given_elsewhere(field, value, message):
    with pytest.raises(LaunchError, match=message) as e:
        PoolConfig(model="m", **{field: value})
    assert API not in str(e.value)


# ---- the run's config ---------------------------------------------------------------------------

def _generator_block(**auth_settings):
    return ConfigDict(dict(urls=(), auth=ConfigDict(dict(
        dict(api_key_file="", admin_api_key_file="", generate_keys=True), **auth_settings))))


def test_run_keys_from_files_environment_or_generated(tmp_path, monkeypatch):
    from rl_jax.orchestrator.pool import generator_keys
    from rl_jax.recipe.schema import RLConfigError
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    (tmp_path / "api").write_text(API)
    block = _generator_block(api_key_file=str(tmp_path / "api"))
    assert generator_keys(block) == Keys(API)
    assert generator_keys(_generator_block(), environ={ADMIN_API_KEY_ENV: ADMIN}) == \
        Keys(None, ADMIN)
    generated = [generator_keys(_generator_block(), environ={}) for _ in range(2)]
    assert all(k.api_key and k.admin_api_key and k.api_key != k.admin_api_key
               for k in generated)
    assert generated[0] != generated[1]  # fresh for every run
    assert generator_keys(_generator_block(generate_keys=False), environ={}) == Keys()
    external = _generator_block()
    external.urls = ("http://gen0:30000",)  # servers given by URL: their keys, or none
    assert generator_keys(external, environ={}) == Keys()
    with pytest.raises(RLConfigError, match="generator.auth: admin_api_key_file file '.*nope'"):
        generator_keys(_generator_block(admin_api_key_file=str(tmp_path / "nope")))


@pytest.mark.parametrize("override, message", [
    ({"api_key": API}, "generator.auth has unknown settings \\['api_key'\\]"),
    ({"api_key_file": 3}, "generator.auth.api_key_file must be a file path"),
    ({"generate_keys": "yes"}, "generator.auth.generate_keys must be true or false"),
])
def test_run_config_names_key_files_never_keys(override, message):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rl_jax.orchestrator.config import validate
    from rl_jax.recipe.schema import RLConfigError
    spec = importlib.util.spec_from_file_location(
        "tiny_rl", Path(__file__).resolve().parents[1] / "configs/tiny_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    validate(c)
    c.generator.auth = ConfigDict({**c.generator.auth.to_dict(), **override})
    with pytest.raises(RLConfigError, match=message) as e:
        validate(c)
    assert API not in str(e.value)


# ---- real servers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"), names=("a", "b"))


def _pool(ckpt, log_dir, keys, host="127.0.0.1", count=1):
    return ServerPool(PoolConfig(model=str(ckpt), host=host, ports=(0,) * count, max_slots=8,
                                 max_seq_len=64, env=server_env(), startup_timeout=300,
                                 log_dir=str(log_dir), keys=keys, extra_args=("--nowarmup",)))


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    """Four servers started side by side: both keys; the API key only; the admin key only,
    bound beyond loopback; no keys, bound beyond loopback."""
    pools = {
        "both": _pool(ckpts["a"], tmp_path_factory.mktemp("both"), Keys(API, ADMIN)),
        "api": _pool(ckpts["a"], tmp_path_factory.mktemp("api"), Keys(API)),
        "admin": _pool(ckpts["a"], tmp_path_factory.mktemp("admin"), Keys(None, ADMIN),
                       host="0.0.0.0"),
        "none": _pool(ckpts["a"], tmp_path_factory.mktemp("none"), Keys(), host="0.0.0.0"),
    }
    try:
        for pool in pools.values():
            pool.start(wait=False)
        for pool in pools.values():
            pool.wait_healthy()
        yield pools
    finally:
        for pool in pools.values():
            pool.stop()


def url_of(pool):
    return pool.urls[0].replace("0.0.0.0", "127.0.0.1")


VERSIONS = itertools.count(7)  # weight versions of the updates from disk below


def call(url, method, path, body, ckpt, headers=None):
    if body == "CHECKPOINT":
        body = {"model_path": str(ckpt), "weight_version": next(VERSIONS)}
    return http(url, path, body, method=method, headers=headers, timeout=120)


def server_state(url):
    status, info, _ = http(url, "/get_server_info", headers=bearer(API))
    assert status == 200, info
    return info["paused"], info["weight_version"], info["http_requests"]


def test_admin_endpoints_refuse_all_but_the_admin_key(servers, ckpts):
    url = url_of(servers["both"])
    paused, version, _ = server_state(url)
    for method, path, body in ADMIN_ENDPOINTS:
        for headers in ({}, bearer(WRONG), bearer(API), {"x-api-key": API}, bearer(ADMIN + "x"),
                        {"Authorization": f"Basic {ADMIN}"}):
            status, data, _ = call(url, method, path, body, ckpts["b"], headers)
            assert status == 403, (method, path, headers, data)
            assert data["error"]["type"] == "forbidden" and data["error"]["code"] == 403
            assert "admin API key" in data["error"]["message"]
    # other spellings of an admin path reach no admin endpoint with the API key
    for spelling in ("/pause_generation/", "//pause_generation", "/./pause_generation",
                     "/pause_generation?mode=abort", "/%70ause_generation",
                     "/pause_generation%2F", "/PAUSE_GENERATION"):
        status, data, _ = http(url, spelling, {"mode": "abort"}, headers=bearer(API))
        assert status in (403, 404), (spelling, status, data)
    # nothing changed: not paused, same weights
    assert server_state(url)[:2] == (paused, version)


def test_admin_endpoints_run_with_the_admin_key(servers, ckpts):
    url = url_of(servers["both"])
    for headers in (bearer(ADMIN), {"x-api-key": ADMIN}):
        for method, path, body in ADMIN_ENDPOINTS:
            status, data, _ = call(url, method, path, body, ckpts["b"], headers)
            if path == "/update_weights_from_transfer":  # authorised, but this server was
                # started without a publisher: its transfer token goes to none
                assert status == 403 and "admin API key" not in data["error"]["message"], data
                assert "started without a publisher" in data["error"]["message"], data
            elif path in REFUSED_FOR_WHAT_THEY_ASK:
                assert status == 400 and data["success"] is False, (path, data)
            else:
                assert status == 200, (method, path, data)
    paused, version, _ = server_state(url)
    assert not paused and version == next(VERSIONS) - 1  # the last update


def test_normal_endpoints_refuse_a_missing_or_wrong_key(servers, ckpts):
    url = url_of(servers["both"])
    for method, path, body in NORMAL_ENDPOINTS + [("GET", "/no_such_endpoint", None)]:
        for headers in ({}, bearer(WRONG), {"x-api-key": WRONG}, bearer(ADMIN),
                        {"Authorization": API}, {"Authorization": "Bearer"}):
            status, data, response_headers = call(url, method, path, body, ckpts["a"], headers)
            assert status == 401, (method, path, headers, data)
            assert data["error"]["type"] == "unauthorized" and data["error"]["code"] == 401
            assert response_headers["WWW-Authenticate"].startswith("Bearer")
            assert API not in json.dumps(data) and ADMIN not in json.dumps(data)


def test_normal_endpoints_answer_either_header_form(servers, ckpts):
    url = url_of(servers["both"])
    for method, path, body in NORMAL_ENDPOINTS:
        for headers in (bearer(API), {"x-api-key": API}, {"Authorization": f"bearer {API}"}):
            status, data, _ = call(url, method, path, body, ckpts["a"], headers)
            assert status == 200, (method, path, headers, data)
    status, data, _ = http(url, "/no_such_endpoint", headers=bearer(API))
    assert status == 404


def test_health_stays_open(servers):
    for name, pool in servers.items():
        for _, path, _ in OPEN_ENDPOINTS:
            status, data, _ = http(url_of(pool), path, timeout=60)
            assert status == 200, (name, path, data)


def test_one_key_servers_follow_sglang(servers, ckpts):
    api, admin = url_of(servers["api"]), url_of(servers["admin"])
    gen = NORMAL_ENDPOINTS[0]
    # API key only: it opens every endpoint, admin ones included
    assert call(api, *gen, ckpts["a"])[0] == 401
    assert call(api, *gen, ckpts["a"], bearer(API))[0] == 200
    assert call(api, "POST", "/pause_generation", {}, None)[0] == 401
    assert call(api, "POST", "/pause_generation", {}, None, bearer(API))[0] == 200
    assert call(api, "POST", "/continue_generation", {}, None, {"x-api-key": API})[0] == 200
    # admin key only: normal endpoints open, admin endpoints need it
    assert call(admin, *gen, ckpts["a"])[0] == 200
    assert call(admin, "POST", "/flush_cache", {}, None)[0] == 403
    assert call(admin, "POST", "/flush_cache", {}, None, bearer(API))[0] == 403
    assert call(admin, "POST", "/flush_cache", {}, None, bearer(ADMIN))[0] == 200
    # no keys: open
    assert call(url_of(servers["none"]), "POST", "/flush_cache", {}, None)[0] == 200


def test_keys_are_in_no_command_line_or_log(servers):
    for name, pool in servers.items():
        process = pool.processes[0]
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert API not in cmdline and ADMIN not in cmdline, name
        log = pool.log_files[0].read_text()
        assert API not in log and ADMIN not in log, name
        assert WRONG not in log


def test_servers_beyond_loopback_without_keys_warn(servers):
    logs = {name: pool.log_files[0].read_text() for name, pool in servers.items()}
    assert "WARNING: serving on 0.0.0.0 without API keys" in logs["none"]
    assert "WARNING: serving on 0.0.0.0 with an admin key only" in logs["admin"]
    assert "WARNING" not in logs["both"] and "WARNING" not in logs["api"]


def test_client_generates_and_controls_through_keys(servers, ckpts):
    pool = servers["both"]

    def req(n=2):
        return GenerateRequest([1, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True, n=n))

    async def main():
        async with GeneratorClient(pool.urls, keys=pool.config.keys) as client:
            assert all((await client.check_health()).values())
            outputs = await client.generate(req())
            assert len(outputs) == 2 and all(len(o.output_ids) == 4 for o in outputs)
            batch = await client.generate_batch([req(1), req(3)])
            assert [len(b) for b in batch] == [1, 3]
            await client.pause("abort")
            await client.resume()
            assert await client.flush_cache()
            await client.abort("nobody")
            newer = await client.weight_version() + 1  # versions may not go back
            version = await client.update_weights_from_disk(ckpts["a"], newer)
            assert version == newer and await client.weight_version() == newer
            outputs = await client.generate(req(1))
            assert outputs[0].output_versions == [newer] * 4
            state["version"] = newer
        # a client without keys, or with the API key only
        async with GeneratorClient(pool.urls) as client:
            with pytest.raises(GeneratorRequestError, match="401: /generate needs") as e:
                await client.generate(req())
            assert e.value.status == 401 and client.stats["retries"] == 0
        async with GeneratorClient(pool.urls, keys=Keys(API)) as client:
            assert len(await client.generate(req(1))) == 1
            with pytest.raises(GeneratorRequestError, match="403") as e:
                await client.pause("abort")
            assert e.value.status == 403
            with pytest.raises(GeneratorRequestError, match="403"):
                await client.update_weights_from_disk(ckpts["b"], state["version"] + 1)

    state = {}
    asyncio.run(main())
    paused, version, _ = server_state(url_of(pool))
    assert not paused and version == state["version"]


def test_a_run_with_wrong_keys_stops_at_start(servers):
    from rl_jax.orchestrator.pool import check_keys
    from rl_jax.recipe.schema import RLConfigError
    pool = servers["both"]

    async def check(keys):
        async with GeneratorClient(pool.urls, keys=keys) as client:
            await check_keys(client)

    asyncio.run(check(Keys(API, ADMIN)))
    for keys, message in ((Keys(), "refused this run's API key \\(HTTP 401\\)"),
                          (Keys(WRONG, ADMIN), "refused this run's API key \\(HTTP 401\\)"),
                          (Keys(API), "refused this run's admin key \\(HTTP 403\\)"),
                          (Keys(API, WRONG), "refused this run's admin key \\(HTTP 403\\)")):
        with pytest.raises(RLConfigError, match=message) as e:
            asyncio.run(check(keys))
        assert API not in str(e.value) and ADMIN not in str(e.value)


# ---- SGLang's router ----------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                    reason="sglang-router is not installed (the [test] extra)")
def test_sglang_router_in_front_of_keyed_servers(servers, tmp_path):
    """The router holds the API key (its --api-key: the key it sends to workers and asks of its
    clients): it registers keyed workers and forwards generation; it cannot reach their admin
    endpoints, which need the admin key (the client sends control calls to servers directly)."""
    pool = servers["both"]
    port = free_port()
    log_file = tmp_path / "router.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *pool.urls,
             "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--prometheus-port", str(free_port()), "--log-level", "warn", "--api-key", API],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_file.read_text()[-3000:]
            try:
                status, data, _ = http(url, "/workers", headers=bearer(API), timeout=2)
                if status == 200 and [w["is_healthy"] for w in data["workers"]] == [True]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_file.read_text()[-3000:]
            time.sleep(0.2)
        before = server_state(url_of(pool))[2].get("/generate", 0)
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 3,
                                                            "ignore_eos": True}}
        status, data, _ = http(url, "/generate", body, headers=bearer(API))
        assert status == 200 and len(data["output_ids"]) == 3, data
        assert server_state(url_of(pool))[2]["/generate"] == before + 1
        for headers in ({}, bearer(WRONG)):
            assert http(url, "/generate", body, headers=headers)[0] == 401
        status, data, _ = http(url, "/flush_cache", {}, headers=bearer(API))
        assert [f["error"] for f in data["failed"]] == ["HTTP 403 Forbidden"], data
    finally:
        process.terminate()
        process.wait(timeout=30)
