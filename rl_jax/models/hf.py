"""Hugging Face checkpoint interop: ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json``).

:func:`load_pretrained` reads tensors lazily, one parameter at a time, and hands each device only
its own slice (``jax.make_array_from_callback``), so no device ever holds the whole model.
:func:`save_pretrained` writes the layout transformers and SGLang load, atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rl_jax.errors import UserError
from rl_jax.models.build import abstract_model, iter_params, param_shardings
from rl_jax.models.config import ConfigError, ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import ShardingRules

INDEX_FILE = "model.safetensors.index.json"
# Tensors HF checkpoints may carry that are not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(UserError, ValueError):
    """An HF checkpoint directory that cannot be read into (or written from) this model."""


@dataclass(frozen=True)
class _Mapping:
    """How one of our parameters is stored in HF format (per layer for stacked ones)."""

    hf_name: str  # may contain "{i}" for the layer index
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
    return x


def _transpose(x):
    return x.T


def hf_mappings(cfg: ModelConfig) -> dict[str, _Mapping]:
    """Our parameter name → its HF tensor name, HF shape and layout transforms."""
    d, f, h, k, hd, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)

    def in_proj(heads):  # HF [heads*hd, D] <-> ours [D, heads, hd]
        return dict(hf_shape=(heads * hd, d),
                    to_ours=lambda x: x.reshape(heads, hd, d).transpose(2, 0, 1),
                    to_hf=lambda x: x.transpose(1, 2, 0).reshape(heads * hd, d))

    def bias(heads):  # HF [heads*hd] <-> ours [heads, hd]
        return dict(hf_shape=(heads * hd,), to_ours=lambda x: x.reshape(heads, hd),
                    to_hf=lambda x: x.reshape(heads * hd))

    plain = dict(to_ours=_identity, to_hf=_identity)
    linear = dict(to_ours=_transpose, to_hf=_transpose)
    layer = "model.layers.{i}."
    maps = {
        "embed": _Mapping("model.embed_tokens.weight", (v, d), **plain),
        "final_norm": _Mapping("model.norm.weight", (d,), **plain),
        "layers.attn_norm": _Mapping(layer + "input_layernorm.weight", (d,), **plain),
        "layers.mlp_norm": _Mapping(layer + "post_attention_layernorm.weight", (d,), **plain),
        "layers.wq": _Mapping(layer + "self_attn.q_proj.weight", **in_proj(h)),
        "layers.wk": _Mapping(layer + "self_attn.k_proj.weight", **in_proj(k)),
        "layers.wv": _Mapping(layer + "self_attn.v_proj.weight", **in_proj(k)),
        "layers.wo": _Mapping(layer + "self_attn.o_proj.weight", (d, h * hd),
                              to_ours=lambda x: x.reshape(d, h, hd).transpose(1, 2, 0),
                              to_hf=lambda x: x.transpose(2, 0, 1).reshape(d, h * hd)),
        "layers.w_gate": _Mapping(layer + "mlp.gate_proj.weight", (f, d), **linear),
        "layers.w_up": _Mapping(layer + "mlp.up_proj.weight", (f, d), **linear),
        "layers.w_down": _Mapping(layer + "mlp.down_proj.weight", (d, f), **linear),
    }
    if cfg.attention_bias:
        maps["layers.bq"] = _Mapping(layer + "self_attn.q_proj.bias", **bias(h))
        maps["layers.bk"] = _Mapping(layer + "self_attn.k_proj.bias", **bias(k))
        maps["layers.bv"] = _Mapping(layer + "self_attn.v_proj.bias", **bias(k))
    if cfg.output_bias:
        maps["layers.bo"] = _Mapping(layer + "self_attn.o_proj.bias", (d,), **plain)
    if cfg.qk_norm:
        maps["layers.q_norm"] = _Mapping(layer + "self_attn.q_norm.weight", (hd,), **plain)
        maps["layers.k_norm"] = _Mapping(layer + "self_attn.k_norm.weight", (hd,), **plain)
    if not cfg.tie_word_embeddings:
        maps["lm_head"] = _Mapping("lm_head.weight", (v, d), **linear)
    return maps


# ---- reading ------------------------------------------------------------------------------------

def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # e.g. a name longer than the filesystem allows
        raise CheckpointError(f"checkpoint directory {str(path)[:200]!r} cannot be read: "
                              f"{e.strerror or e}") from None
    if not is_dir:
        raise CheckpointError(f"checkpoint directory {str(path)[:200]!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} is missing: an HF checkpoint needs config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(f"{config_file}: {e}") from e


class _TensorReader:
    """Lazy access to the tensors of a directory of safetensors files."""

    def __init__(self, path: Path):
        index_file = path / INDEX_FILE
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_file} is not a valid safetensors index: {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self._handles = {}
        self.location: dict[str, str] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in {INDEX_FILE} but missing")
            try:
                handle = safe_open(str(file), framework="numpy")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{file} is not a readable safetensors file "
                                      f"(corrupt or truncated?): {e}") from e
            self._handles[name] = handle
            for key in keys:
                self.location[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.location.get(key) != name:
                    raise CheckpointError(f"{INDEX_FILE} says {key!r} is in {name}, but it is not")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype, as safetensors names it (``F32``, ``BF16``, ``I8``, ``BOOL``...)."""
        return str(self._handles[self.location[name]].get_slice(name).get_dtype())

    def get(self, name: str) -> np.ndarray:
        try:
            return self._handles[self.location[name]].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from "
                                  f"{self.location[name]}: {e}") from e


def _check_tensors(reader: _TensorReader, cfg: ModelConfig, maps: dict[str, _Mapping]):
    expected = {}
    for m in maps.values():
        names = [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in m.hf_name \
            else [m.hf_name]
        for n in names:
            expected[n] = m.hf_shape
    missing = sorted(set(expected) - set(reader.location))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the config "
                              f"requires, e.g. {missing[:5]}")
    extra = sorted(n for n in set(reader.location) - set(expected)
                   if not n.endswith(_IGNORED_SUFFIXES)
                   and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} tensor(s) this config does not use "
                              f"(wrong architecture or num_hidden_layers?), e.g. {extra[:5]}")
    for n, shape in expected.items():
        got = reader.shape(n)
        if got != shape:
            raise CheckpointError(f"shape mismatch between config and weights: tensor {n!r} "
                                  f"has shape {got}, config.json implies {shape}")
    # Before anything is cast to the model's dtype: a cast would turn integers (a quantised
    # checkpoint without its scales, or a corrupted one) into plausible-looking weights.
    stored = {n: reader.dtype(n) for n in expected}
    bad = sorted(f"{n}: {d}" for n, d in stored.items() if not d.startswith(("F", "BF")))
    if bad:
        raise CheckpointError(f"checkpoint has {len(bad)} tensor(s) stored in a dtype that "
                              f"cannot hold weights (floating point only), e.g. {bad[:5]}")


def load_pretrained(path: str | os.PathLike, mesh: Mesh | None = None, dtype: Any = jnp.float32,
                    *, param_dtype: Any = None, rules: ShardingRules | None = None,
                    remat: str = "none") -> Transformer:
    """Reads an HF checkpoint directory into a (sharded) :class:`Transformer`.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or sharded
        ``model-0000x-of-0000y.safetensors`` files with ``model.safetensors.index.json``.
      mesh: when given, parameters are placed on it according to ``rules``; each device
        receives only its own slices.
      dtype: computation dtype; also the parameter dtype unless ``param_dtype`` is given.
    """
    path = Path(path)
    cfg = read_config(path)
    param_dtype = dtype if param_dtype is None else param_dtype
    rules = rules or ShardingRules.default()
    reader = _TensorReader(path)
    maps = hf_mappings(cfg)
    _check_tensors(reader, cfg, maps)

    graphdef, abstract_state = nnx.split(abstract_model(
        cfg, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules, remat=remat))
    shardings = dict(iter_params(param_shardings(abstract_state, mesh, rules)))
    np_dtype = np.dtype(jnp.dtype(param_dtype))

    loaded = {}
    for name, var in iter_params(abstract_state):
        m = maps[name]
        sharding = shardings[name].get_value()
        if "{i}" in m.hf_name:
            cache: dict[int, np.ndarray] = {}

            def layer_tensor(i, m=m, cache=cache):
                if i not in cache:
                    cache[i] = m.to_ours(reader.get(m.hf_name.format(i=i))).astype(np_dtype)
                return cache[i]

            def callback(index, layer_tensor=layer_tensor, n=var.shape[0]):
                layers = range(*index[0].indices(n))
                return np.stack([layer_tensor(i)[index[1:]] for i in layers])
        else:
            full = m.to_ours(reader.get(m.hf_name)).astype(np_dtype)

            def callback(index, full=full):
                return full[index]

        loaded[name] = jax.make_array_from_callback(var.shape, sharding, callback)
    state = nnx.map_state(lambda p, v: v.replace(loaded[".".join(map(str, p))]), abstract_state)
    return nnx.merge(graphdef, state)


def load_tokenizer(path: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` saved in ``path/tokenizer.json``."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{file} is not a valid tokenizer file: {e}") from e


# ---- writing ------------------------------------------------------------------------------------

def _to_host(x: jax.Array | np.ndarray) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(model: Transformer, path: str | os.PathLike, *, tokenizer=None,
                    dtype: Any = None, max_shard_bytes: int = 4 << 30) -> Path:
    """Writes ``model`` as an HF checkpoint directory (atomically: a complete directory replaces
    any old one, or nothing changes).

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` to store as ``tokenizer.json``.
      dtype: storage dtype (default: the parameters' dtype).
      max_shard_bytes: split into ``model-0000x-of-0000y.safetensors`` files above this size.

    In a multi-process run every process must call this (parameters are gathered collectively);
    only process 0 writes.
    """
    if getattr(model, "lora", None) is not None:
        raise CheckpointError("save_pretrained writes a plain model; a model with adapters is "
                              "written by rl_jax.models.lora_export (save_merged, or "
                              "save_peft_adapter for the adapters alone)")
    path = Path(path)
    cfg = model.config
    maps = hf_mappings(cfg)
    tensors: dict[str, np.ndarray] = {}
    for name, var in iter_params(nnx.state(model, nnx.Param)):
        value = _to_host(var[...])
        if dtype is not None:
            value = value.astype(np.dtype(jnp.dtype(dtype)))
        m = maps[name]
        if "{i}" in m.hf_name:
            for i in range(cfg.num_layers):
                tensors[m.hf_name.format(i=i)] = np.ascontiguousarray(m.to_hf(value[i]))
        else:
            tensors[m.hf_name] = np.ascontiguousarray(m.to_hf(value))
    if jax.process_index() != 0:
        return path
    stored = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}
    dtype_name = stored.get(next(iter(tensors.values())).dtype, "float32")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for k, shard in enumerate(shards):
                file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
                weight_map.update({n: file for n in shard})
            total = sum(t.nbytes for t in tensors.values())
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype_name), indent=2))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, cfg)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_tokenizer(tokenizer, path: str | os.PathLike, cfg: ModelConfig | None = None):
    """Writes ``tokenizer.json`` and a ``tokenizer_config.json`` naming its special tokens."""
    path = Path(path)
    tokenizer.save(str(path / "tokenizer.json"))
    special = {}
    if cfg is not None:
        for key, tid in (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_id),
                         ("pad_token", cfg.pad_token_id)):
            if isinstance(tid, tuple):
                tid = tid[0]
            if tid is not None:
                special[key] = tokenizer.id_to_token(tid)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=2))


def _replace_dir(new: Path, target: Path):
    """Moves directory ``new`` to ``target``; an existing ``target`` is removed only afterwards."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)
