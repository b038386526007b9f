"""ShardingRules: default specs, collision and unknown-axis refusals, mesh construction errors,
divisibility errors. Meshes are built from explicit device lists, so no computation runs."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.sharding import (DEFAULT_RULES, KNOWN_AXIS_GROUPS, MESH_AXES, ShardingError,
                             ShardingRules, make_mesh)


@pytest.mark.parametrize("logical_axes, expected", [
    (("vocab", "embed"), P("tensor", "fsdp")),
    (("embed", "vocab"), P("fsdp", "tensor")),
    (("layers", "embed", "q_heads", "head_dim"), P(None, "fsdp", "tensor", None)),
    (("layers", "embed", "kv_heads", "head_dim"), P(None, "fsdp", "tensor", None)),
    (("layers", "q_heads", "head_dim", "embed"), P(None, "tensor", None, "fsdp")),
    (("layers", "embed", "mlp"), P(None, "fsdp", "tensor")),
    (("layers", "mlp", "embed"), P(None, "tensor", "fsdp")),
    (("layers", "norm"), P(None, None)),
    (("norm",), P(None)),
    (("act_batch", "act_seq", "act_embed"), P(("data", "fsdp"), None, None)),
    (("act_batch", "act_seq", "act_heads", "head_dim"), P(("data", "fsdp"), None, "tensor", None)),
    (("act_batch", "act_seq", "act_vocab"), P(("data", "fsdp"), None, "tensor")),
    ((None, "not_a_rule"), P(None, None)),
])
def test_default_specs(logical_axes, expected):
    assert ShardingRules.default().spec(logical_axes) == expected


def test_default_rules_accept_every_known_axis_group():
    rules = ShardingRules.default()
    for group in KNOWN_AXIS_GROUPS:
        assert len(rules.spec(group)) == len(group)
    assert set(DEFAULT_RULES) >= {a for g in KNOWN_AXIS_GROUPS for a in g}


def test_replicated_rules_shard_only_the_batch():
    rules = ShardingRules.replicated()
    assert rules.spec(("layers", "embed", "mlp")) == P(None, None, None)
    assert rules.spec(("act_batch", "act_seq")) == P(("data", "fsdp"), None)


def test_rules_are_a_frozen_copy():
    source = dict(DEFAULT_RULES)
    rules = ShardingRules(source)
    source["embed"] = "tensor"
    assert rules.spec(("embed",)) == P("fsdp")
    assert ShardingRules.default().replace(embed=None).spec(("embed",)) == P(None)
    assert ShardingRules.default().spec(("embed",)) == P("fsdp")


def test_two_co_occurring_axes_on_one_mesh_axis_are_refused():
    with pytest.raises(ShardingError) as e:
        ShardingRules.default().replace(mlp="fsdp")
    message = str(e.value)
    assert "'embed'" in message and "'mlp'" in message and "'fsdp'" in message


def test_collision_inside_a_tuple_of_mesh_axes_is_refused():
    with pytest.raises(ShardingError, match="'q_heads'.*'head_dim'|'head_dim'.*'q_heads'"):
        ShardingRules.default().replace(head_dim=("data", "tensor"))


def test_axes_that_never_co_occur_may_share_a_mesh_axis():
    # vocab and mlp both take `tensor` by default; they never appear in one array.
    rules = ShardingRules.default()
    assert rules.mesh_axes("vocab") == rules.mesh_axes("mlp") == ("tensor",)


def test_unknown_mesh_axis_is_refused():
    with pytest.raises(ShardingError, match="'embed'.*unknown mesh axis 'model'"):
        ShardingRules.default().replace(embed="model")
    with pytest.raises(ShardingError, match="unknown mesh axis 'pipeline'"):
        ShardingRules({"act_batch": ("data", "pipeline")})


def test_make_mesh_shapes():
    devices = jax.devices()[:8]
    mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=devices)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(make_mesh(tensor=2, devices=devices).shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert dict(make_mesh(data=-1, fsdp=1, devices=devices[:4]).shape) == {
        "data": 4, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("sizes, n_devices, message", [
    (dict(data=2, fsdp=2, tensor=1), 8, "needs 4 devices but 8 are available"),
    (dict(data=4, fsdp=2, tensor=2), 8, "needs 16 devices but 8 are available"),
    (dict(data=-1, fsdp=-1, tensor=1), 8, "at most one mesh axis may be -1"),
    (dict(data=3, fsdp=-1, tensor=1), 8, "cannot fill mesh"),
    (dict(data=0, fsdp=-1, tensor=1), 8, "cannot fill mesh"),
    (dict(data=0, fsdp=8, tensor=1), 8, "must be positive"),
    (dict(data=1, fsdp=1, tensor=2), 1, "needs 2 devices but 1 are available"),
])
def test_make_mesh_errors(sizes, n_devices, message):
    with pytest.raises(ShardingError, match=message):
        make_mesh(**sizes, devices=jax.devices()[:n_devices])


def test_sharding_divisibility_error_names_parameter_and_axis():
    mesh = make_mesh(data=1, fsdp=1, tensor=4, devices=jax.devices()[:4])
    rules = ShardingRules.default()
    axes = ("layers", "embed", "kv_heads", "head_dim")
    with pytest.raises(ShardingError) as e:
        rules.sharding(mesh, axes, (2, 64, 2, 16), name="layers.wk")
    message = str(e.value)
    assert "layers.wk" in message and "'kv_heads'" in message and "size 2" in message
    ok = rules.sharding(mesh, axes, (2, 64, 4, 16), name="layers.wk")
    assert ok.spec == P(None, "fsdp", "tensor", None)


def test_sharding_divisibility_counts_every_axis_of_a_tuple():
    mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
    rules = ShardingRules.default()
    rules.sharding(mesh, ("act_batch", "act_seq"), (4, 3))
    with pytest.raises(ShardingError,
                       match="tokens: dimension 'act_batch' of size 6 .* total size 4"):
        rules.sharding(mesh, ("act_batch", "act_seq"), (6, 3), name="tokens")


def test_sharding_rank_mismatch_is_refused():
    mesh = make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2])
    with pytest.raises(ShardingError, match="w: shape \\(4, 4, 4\\) has 3 dimensions"):
        ShardingRules.default().sharding(mesh, ("embed", "mlp"), (4, 4, 4), name="w")


def test_sharding_drops_mesh_axes_the_mesh_lacks():
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "fsdp"))
    sharding = ShardingRules.default().sharding(mesh, ("embed", "vocab"), (8, 6))
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == P("fsdp", None)


def test_constrain_without_mesh_is_identity():
    x = np.arange(6.0).reshape(2, 3)
    assert ShardingRules.default().constrain(x, None, ("act_batch", "act_seq")) is x
