"""The RL recipe's typed schema (rl_jax.recipe): every recipe file loads from it, every field's
bad value is refused once with the field's name, command-line overrides reach the run's
settings, unknown keys are errors naming them, and the base policy trains in this process."""

import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from absl import flags
from ml_collections import ConfigDict, config_flags

from rl_jax.recipe import schema
from rl_jax.orchestrator.config import mode_settings
from rl_jax.recipe.checks import load_recipe_file, parse, replace_fields
from rl_jax.recipe.schema import (RLConfigError, RLRecipe, base_config, defaults, field_names,
                                  to_dict)

ROOT = Path(__file__).resolve().parents[1]
RL_RECIPES = ("tiny_rl", "shape_rl_cpu", "qwen2_5_1_5b_math", "qwen2_5_7b_math",
              "qwen3_4b_sorting", "scratchpad_rl", "tool_rl")


def _with(tree: dict, dotted: str, value) -> dict:
    *sections, leaf = dotted.split(".")
    node = tree
    for s in sections:
        node = node[s]
    node[leaf] = value
    return tree


def _field(dotted: str) -> dataclasses.Field:
    cls: type = RLRecipe
    *sections, leaf = dotted.split(".")
    for s in sections:
        cls = typing.get_type_hints(cls)[s]
    return next(f for f in dataclasses.fields(cls) if f.name == leaf)


def _hint(dotted: str):
    cls: type = RLRecipe
    *sections, leaf = dotted.split(".")
    for s in sections:
        cls = typing.get_type_hints(cls)[s]
    return typing.get_type_hints(cls)[leaf]


def _wrong_type(hint):
    """A value no field of type ``hint`` takes."""
    if hint is str or hint == (str | dict[str, typing.Any]):
        return 3
    if hint is bool:
        return "yes"
    if hint in (int, float):
        return "many"
    return 3.5  # tuples and mappings


def _out_of_range(check):
    bad = {schema.not_negative: -1.0, schema.positive: 0.0, schema.fraction_below_one: 1.0,
           schema.http_urls: ("localhost:30000",)}
    if check in bad:
        return bad[check]
    name = check.__qualname__
    if name.startswith("at_least"):
        return check.__closure__[0].cell_contents - 1
    if name.startswith("one_of"):
        return "nonsense"
    return "no prompt marker"  # data.template


def _load(name: str) -> ConfigDict:
    return load_recipe_file(ROOT / "configs" / f"{name}.py")


# ---- the recipe files ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", RL_RECIPES)
def test_rl_recipes_derive_from_the_base_and_parse(name):
    c = _load(name)
    recipe = parse(c)
    assert sorted(field_names()) == sorted(_leaves(c.to_dict()))
    assert recipe.recipe == "rl" and to_dict(recipe)["rollout"] == c.rollout.to_dict()


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("kwargs", "options", "shape"):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def test_every_config_file_loads():
    for path in sorted((ROOT / "configs").glob("*.py")):
        c = load_recipe_file(path)
        assert c.recipe in ("rl", "lm"), path


def test_the_base_holds_the_schema_defaults():
    assert parse(base_config()) == defaults()
    # The pipeline's own settings default to the recipe's.
    from rl_jax.rollout.config import RolloutConfig
    assert RolloutConfig().max_lag == defaults().rollout.max_lag
    assert RolloutConfig().groups_per_batch == defaults().rollout.groups_per_batch


# ---- one check per field -------------------------------------------------------------------------

@pytest.mark.parametrize("name", field_names())
def test_a_wrong_type_is_refused_naming_the_field(name):
    hint = _hint(name)
    if hint == dict[str, typing.Any]:
        value = 3.5
    else:
        value = _wrong_type(hint)
    with pytest.raises(RLConfigError) as e:
        parse(_with(to_dict(defaults()), name, value), registries=False)
    assert str(e.value).startswith(name), str(e.value)
    assert repr(value) in str(e.value)


RANGED = [n for n in field_names() if _field(n).metadata.get("check") is not None]


@pytest.mark.parametrize("name", RANGED)
def test_an_out_of_range_value_is_refused_naming_the_field(name):
    value = _out_of_range(_field(name).metadata["check"])
    with pytest.raises(RLConfigError) as e:
        parse(_with(to_dict(defaults()), name, value), registries=False)
    message = str(e.value)
    assert message.startswith(name) and repr(value if not isinstance(value, tuple)
                                              else value[0]) in message, message


def test_the_message_of_a_bad_staleness_bound():
    with pytest.raises(RLConfigError, match=r"^rollout\.max_lag must be an integer >= 0, "
                                            r"got -1$"):
        parse(_with(to_dict(defaults()), "rollout.max_lag", -1))


@pytest.mark.parametrize("name, value, message", [
    ("loss.name", "ppo2", "loss.name must be one of"),
    ("loss.options", {"epsilon": 0.1}, "loss.options"),
    ("rollout.advantage", "best", "rollout.advantage must be one of"),
    ("env.name", "chess", "env.name must be one of"),
    ("model.dtype", "float8", "model.dtype: unknown dtype 'float8'"),
    ("export.dtype", "int4", "export.dtype: unknown dtype 'int4'"),
    ("optimizer.schedule_on", "moon", "optimizer.schedule_on must be one of"),
    ("cpus.generators_nice", 20, "cpus.generators_nice must be an integer from 0"),
    ("transfer.transports", ("shm", "pigeon"), "transfer.transports must name one or more of"),
    ("transfer.transport", "pigeon", "transfer.transport must be 'auto' or one of"),
    ("transfer.transport", "delta", "transfer.transport='delta' is not offered"),
])
def test_registered_names_are_checked(name, value, message):
    tree = _with(to_dict(defaults()), name, value)
    parse(tree, registries=False)  # the planner's reading does not import the registries
    with pytest.raises(RLConfigError, match=message.replace("(", r"\(")):
        parse(tree)


def test_unknown_fields_are_named():
    tree = to_dict(defaults())
    tree["rollout"]["max_lagg"] = 3
    with pytest.raises(RLConfigError, match=r"rollout has unknown settings \['max_lagg'\]"):
        parse(tree)
    tree = to_dict(defaults())
    tree["mystery"] = {}
    with pytest.raises(RLConfigError, match=r"the recipe has unknown settings \['mystery'\]"):
        parse(tree)


def test_replace_changes_fields_and_checks_them_again():
    recipe = parse(_load("tiny_rl"))
    changed = replace_fields(recipe, {"distributed.num_processes": 2,
                                      "distributed.process_id": 1})
    assert changed.distributed.process_id == 1 and changed.rollout == recipe.rollout
    with pytest.raises(RLConfigError, match="distributed.process_id=2 is outside"):
        replace_fields(recipe, {"distributed.num_processes": 2, "distributed.process_id": 2})
    with pytest.raises(RLConfigError, match="unknown recipe field 'trainer.stepz'"):
        replace_fields(recipe, {"trainer.stepz": 3})


# ---- the command line ----------------------------------------------------------------------------

def _flags(*overrides: str):
    """The recipe as ``launch.train`` parses its command line (absl + config_flags)."""
    argv = ["prog", f"--config={ROOT / 'configs/tiny_rl.py'}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "recipe", flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    fv(argv)
    return fv.config


def test_overrides_reach_the_run_settings():
    from rl_jax.orchestrator.setup import rollout_config
    recipe = parse(_flags("--config.rollout.max_lag=4", "--config.trainer.ema_decay=0.5",
                          "--config.generator.urls=('http://127.0.0.1:9',)"))
    assert recipe.rollout.max_lag == 4 and recipe.trainer.ema_decay == 0.5
    assert recipe.generator.urls == ("http://127.0.0.1:9",)
    assert rollout_config(recipe, mode_settings(recipe)).max_lag == 4
    sync = parse(_flags("--config.rollout.max_lag=4", "--config.mode=sync"))
    assert rollout_config(sync, mode_settings(sync)).max_lag == 0  # sync's own bound


@pytest.mark.parametrize("override", ["--config.foo=1", "--config.rollout.nonsense=1"])
def test_unknown_override_keys_are_errors_naming_them(override):
    with pytest.raises(Exception) as e:
        _flags(override)
    key = override.split("=")[0].removeprefix("--config.")
    assert key.split(".")[-1] in str(e.value) + str(e.value.__cause__)


def _launch(workdir: Path, *flags_: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
                           f"--workdir={workdir}", *flags_], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("flag, message", [
    ("--config.foo=1", "foo"),
    ("--config.rollout.max_lag=-1", "rollout.max_lag must be an integer >= 0, got -1"),
    ("--config.data.template=plain", "data.template must contain '{prompt}'"),
])
def test_the_launcher_stops_with_one_line(tmp_path, flag, message):
    result = _launch(tmp_path / "bad", flag)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "bad" / "base").exists()  # refused before any work


# ---- the base policy -----------------------------------------------------------------------------

LM_SMALL = ("trainer.steps=4", "checkpoint.every=2", "logging.every=1", "logging.eval_every=2",
            "data.rows_per_batch=8", "data.eval_examples=16", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_layers=2", "model.head_dim=8",
            "checkpoint.use_async=False")


def test_a_bad_base_override_is_named(tmp_path):
    from rl_jax.orchestrator.rl import ensure_base_checkpoint
    c = _load("tiny_rl")
    c.base.lm_overrides = ("trainer.stepz=3",)
    with pytest.raises(RLConfigError, match="base.lm_overrides: 'trainer.stepz' is not a field"):
        ensure_base_checkpoint(c, tmp_path)
    c.base.lm_overrides = ("trainer.steps=many",)
    with pytest.raises(RLConfigError, match="base.lm_overrides: trainer.steps='many'"):
        ensure_base_checkpoint(c, tmp_path)


@pytest.mark.slow
def test_the_base_policy_trains_in_process_as_the_launcher_would(tmp_path, capsys):
    """The supervised step runs in this process (its output reaches this process's
    sys.stdout, which a child's would not) and writes what ``python -m launch.train`` writes
    for the same recipe and overrides, with the same losses."""
    from rl_jax.orchestrator.rl import ensure_base_checkpoint
    c = _load("tiny_rl")
    c.base.lm_overrides = tuple(c.base.lm_overrides) + LM_SMALL
    hf = ensure_base_checkpoint(c, tmp_path / "rl")
    out = capsys.readouterr().out
    assert "no base policy yet: training it with configs/tiny_lm.py" in out
    assert "exported" in out
    assert hf == tmp_path / "rl" / "base" / "hf" and (hf / "config.json").is_file()

    launched = tmp_path / "launched"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py",
         f"--workdir={launched}", *(f"--config.{o}" for o in c.base.lm_overrides)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def files(root: Path) -> list[str]:
        """Files outside the checkpoints, and the checkpointed steps (orbax names its data
        files at random)."""
        return sorted([str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                       and p.relative_to(root).parts[0] != "checkpoints"] +
                      [p.name for p in (root / "checkpoints").iterdir()])

    base = tmp_path / "rl" / "base"
    assert files(base) == files(launched)

    def losses(root: Path) -> dict:
        rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses(base) == losses(launched) and len(losses(base)) == 4
    # A second call finds the policy and trains nothing.
    assert ensure_base_checkpoint(c, tmp_path / "rl") == hf
    assert "training it" not in capsys.readouterr().out


# ---- user errors ---------------------------------------------------------------------------------

def test_user_errors_derive_from_one_leaf_base():
    """rl_jax.errors imports no package; each package's user-facing errors derive from its
    UserError, which is what the launchers catch."""
    import ast

    from rl_jax.compile_cache import CacheDirError
    from rl_jax.envs.sandbox.limits import SandboxError
    from rl_jax.errors import USER_ERRORS, UserError
    from rl_jax.losses.advantages import GroupSizeError
    from rl_jax.losses.configs import LossConfigError
    from rl_jax.models.config import ConfigError
    from rl_jax.models.hf import CheckpointError
    from rl_jax.orchestrator.weights import StagingSpaceStop
    from rl_jax.sharding import ShardingError
    from rl_jax.sysmodel.errors import SysModelError
    from rl_jax.trainer.checkpoint import CheckpointRestoreError
    from rl_jax.trainer.lm import RecipeConfigError

    tree = ast.parse((ROOT / "rl_jax/errors.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for error in (ConfigError, CheckpointError, ShardingError, CheckpointRestoreError,
                  RecipeConfigError, LossConfigError, GroupSizeError, RLConfigError,
                  CacheDirError, SysModelError, SandboxError, StagingSpaceStop):
        assert issubclass(error, USER_ERRORS) and issubclass(error, UserError), error
    assert issubclass(RLConfigError, ValueError)  # callers catching ValueError still do
    assert issubclass(CheckpointRestoreError, RuntimeError)
    assert issubclass(SandboxError, RuntimeError)


def test_weight_sidecars_need_sglang_servers_started_by_the_run():
    recipe = parse(_load("tiny_rl_sglang"))
    assert recipe.generator.sglang_weights == "disk"
    changed = replace_fields(recipe, {"generator.sglang_weights": "sidecar"})
    assert changed.generator.sglang_weights == "sidecar"
    for changes in ({"generator.kind": "rl_jax"},
                    {"generator.urls": ("http://127.0.0.1:30000",)},
                    {"generator.router_url": "http://127.0.0.1:30001"}):
        with pytest.raises(RLConfigError, match="sglang_weights='sidecar' starts a weight "
                                                "sidecar beside each SGLang server"):
            replace_fields(recipe, {"generator.sglang_weights": "sidecar", **changes})
    with pytest.raises(RLConfigError, match="generator.sglang_weights must be one of"):
        replace_fields(recipe, {"generator.sglang_weights": "pigeon"})
