"""The inference engine's compiled device work for one model: :class:`ModelRunner`.

A runner owns a slot KV cache (:mod:`rl_jax.generator.kv_cache`: its layout, admission and slot
moves), the per-slot decode state and the jitted programs over them: prefill and decode steps of
the decode-path model (:mod:`rl_jax.generator.decode`) with sampling
(:mod:`rl_jax.generator.sampling`), cache resizes as the longest sequence grows and shrinks, and
the decode attention backend (:mod:`rl_jax.generator.kernels`). Steps chain on the device: the
host dispatches step ``t+1`` before it reads the tokens of step ``t``.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rl_jax.generator import kernels
from rl_jax.generator.decode import (decode, decode_many, decode_weight_axes, prefill,
                                     prepare_decode_weights)
from rl_jax.generator.kv_cache import (K_CACHE_AXES, MIN_ADMIT, MIN_KV_LEN, SLOT_FIELDS,
                                       V_CACHE_AXES, V_SEQ_AXIS, SlotState, first_tokens,
                                       install_kv, install_state, kv_bucket, move_slots,
                                       resize_cache, slot_chunks)
from rl_jax.generator.types import GeneratorError
from rl_jax.generator.weights import generator_rules
from rl_jax.models.config import ModelConfig
from rl_jax.sharding import ShardingRules

log = logging.getLogger(__name__)


def _padded(values: Any, n: int, dtype: Any, fill: Any = 0) -> np.ndarray:
    """``values`` as a ``[n]`` array of ``dtype``, ``fill`` after them (no copy when it already
    is one)."""
    values = np.asarray(values, dtype)
    if len(values) == n:
        return values
    out = np.full((n,), fill, dtype)
    out[:len(values)] = values
    return out



class ModelRunner:
    """Owns the KV cache, the per-slot decode state and the compiled functions for one model.

    Calls are asynchronous (JAX dispatch): :meth:`admit` and :meth:`decode` return device arrays
    and chain through the donated cache and state, so the host can queue a step before reading
    the previous one's tokens.
    """

    def __init__(self, config: ModelConfig, *, max_slots: int, max_seq_len: int,
                 mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 dtype: Any = jnp.float32, cache_dtype: Any = None, attention: str = "auto"):
        self.config = config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.mesh = mesh
        self.rules = rules or generator_rules()
        self.dtype = dtype
        self.cache_dtype = cache_dtype or dtype
        constrain = None
        if mesh is not None:
            constrain = partial(self.rules.constrain, mesh=mesh)
            constrain = (lambda x, axes, _c=constrain: _c(x, logical_axes=axes))
        self.cache_bytes = (2 * config.num_layers * max_slots * max_seq_len * config.num_kv_heads
                            * config.head_dim * jnp.dtype(self.cache_dtype).itemsize)
        self._zeros: dict[int, Any] = {}
        self._resizers: dict[int, Any] = {}
        # decode programs (batch, length, filtered, steps) compiled or under way
        self._compiled: set[tuple[int, int, bool, int]] = set()
        self._compile_lock = threading.Lock()  # the warm-up compiles beside the scheduler
        self._compiling: dict[tuple[int, int, bool, int], threading.Event] = {}  # ahead
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, max_seq_len))
        self._state_sharding = self._sharding(("act_batch",), (max_slots,), "slot state")
        self.state = self._initial_state()
        kw = dict(cfg=config, dtype=dtype, constrain=constrain)
        # the decode attention: "native" (the CPU kernel), "pallas" or "xla" (attend)
        self.attention_backend = self._choose_attention(attention)
        self.native_attention = self.attention_backend == "native"
        self._prefill = jax.jit(partial(prefill, **kw))
        kw["attention"] = self._attention_kernel()
        self._decode = jax.jit(partial(decode, max_seq_len=max_seq_len, **kw),
                               static_argnames=("batch", "filtered"), donate_argnums=(1, 2, 3))
        self._decode_many = jax.jit(partial(decode_many, max_seq_len=max_seq_len, **kw),
                                    static_argnames=("steps", "batch", "filtered"),
                                    donate_argnums=(1, 2, 3))
        self._first_tokens = jax.jit(first_tokens, static_argnames=("filtered",))
        self._install_kv = jax.jit(install_kv, donate_argnums=(0, 1))
        self._install_state = jax.jit(install_state, donate_argnums=(0,))
        self._move = jax.jit(move_slots, donate_argnums=(0, 1, 2))
        prepare_kw = {} if mesh is None else {"out_shardings": self._weight_shardings()}
        self._prepare = jax.jit(partial(prepare_decode_weights, cfg=config, dtype=dtype),
                                **prepare_kw)

    def _devices(self) -> list:
        return jax.devices()[:1] if self.mesh is None else list(self.mesh.devices.flat)

    def _choose_attention(self, attention: str) -> str:
        """The decode attention for ``attention`` (:data:`kernels.BACKENDS`): ``"xla"``
        (``decode.attend``); ``"native"`` (the CPU kernel, an error where it cannot run);
        ``"pallas"`` (the Pallas kernel on one device of any backend -- on CPU in Pallas'
        interpreter, slow -- an error where it does not compile); ``"auto"``: on CPU the native
        kernel where it runs and has a specialisation for the model's heads, else XLA's; on
        GPU/TPU the Pallas kernel where it compiles for the model's heads, else XLA's (one log
        line says why)."""
        if attention not in kernels.BACKENDS:
            raise GeneratorError(f"attention must be one of {kernels.BACKENDS}, got "
                                 f"{attention!r}")
        if attention == "xla":
            return "xla"
        platform = self._devices()[0].platform
        if attention == "native" or (attention == "auto" and platform == "cpu"):
            return "native" if self._use_native_attention(attention) else "xla"
        problem = self._pallas_problem(platform)
        if attention == "pallas":
            if problem:
                raise GeneratorError(f"pallas decode attention requested, but {problem}")
            if platform == "cpu":
                log.warning("pallas decode attention on CPU runs in Pallas' interpreter "
                            "(slow; for tests): prefer attention='auto' or 'native' there")
            return "pallas"
        if problem:
            log.warning("pallas decode attention unavailable on %s, using XLA's: %s",
                        platform, problem)
            return "xla"
        return "pallas"

    def _pallas_problem(self, platform: str) -> str | None:
        """Why the Pallas kernel cannot run for this runner (``None`` where it can)."""
        if len(self._devices()) != 1:
            return "it runs on one device only (no sharded form)"
        if platform == "cpu":
            return None  # the interpreter runs any shape
        group = self.config.num_heads // self.config.num_kv_heads
        return kernels.pallas_decode_attention_problem(
            kv_heads=self.config.num_kv_heads, group=group, head_dim=self.config.head_dim,
            max_seq_len=self.max_seq_len, dtype=self.dtype, cache_dtype=self.cache_dtype,
            platform=platform)

    def _attention_kernel(self):
        """The decode attention kernel of :attr:`attention_backend` (``None``:
        ``decode.attend``)."""
        if self.attention_backend == "native":
            return kernels.decode_attention
        if self.attention_backend == "pallas":
            platform = self._devices()[0].platform
            return partial(kernels.pallas_decode_attention, interpret=platform == "cpu",
                           platform=platform)
        return None

    def _use_native_attention(self, attention: str) -> bool:
        """Whether the native CPU kernel runs (``attention`` ``"native"`` or ``"auto"``): where
        it can -- a single CPU device, float32 computation and cache, the kernel built -- and,
        for ``"auto"``, has a specialisation for the model's heads, :data:`kernels.SPECIALISED`.
        An error where ``"native"`` cannot run."""
        devices = self._devices()
        problems = []
        if len(devices) != 1 or devices[0].platform != "cpu":
            problems.append("it runs on one CPU device only")
        if jnp.dtype(self.dtype) != jnp.float32 or jnp.dtype(self.cache_dtype) != jnp.float32:
            problems.append("it computes in float32 over a float32 cache")
        group = self.config.num_heads // self.config.num_kv_heads
        if group > 64:
            problems.append("it takes at most 64 query heads per key/value head")
        if attention == "auto" and (group, self.config.head_dim) not in kernels.SPECIALISED:
            return False  # its generic loops are no faster than XLA's attention
        if not problems and not kernels.decode_attention_available():
            problems.append("it could not be built (see the log)")
        if problems and attention == "native":
            raise GeneratorError("native decode attention requested, but "
                                 + "; ".join(problems))
        return not problems

    @property
    def kv_len(self) -> int:
        """Current length of the cache's position axis."""
        return self.v_cache[0][0].shape[V_SEQ_AXIS]

    def prepare(self, params: dict[str, Any]) -> dict[str, Any]:
        """Decode weights for ``params`` (``decode.prepare_decode_weights``), dispatched
        asynchronously; block on the result before swapping it in to keep the copy off the
        decode path."""
        return self._prepare(params)

    def prefill(self, params, tokens: np.ndarray, lengths: np.ndarray):
        """``(k, v, logits)`` of prompts ``tokens [B, P]`` with true ``lengths [B]``."""
        return self._prefill(params, np.asarray(tokens, np.int32), np.asarray(lengths, np.int32))

    def admit(self, k_new, v_new, logits, rows: np.ndarray, slots: np.ndarray,
              values: dict[str, np.ndarray], fresh: np.ndarray, filtered: bool):
        """Installs prefilled sequences (see ``kv_cache.admit``); returns the packed ``[3, M]``
        first tokens and log-probs (meaningful where ``fresh``)."""
        needed = k_new.shape[2]
        if needed > self.kv_len:
            self._resize(kv_bucket(needed, self.max_seq_len))
        # At least MIN_ADMIT rows (padding goes to a dropped slot): fewer programs to compile.
        # Host arrays go to the programs as they are (the jitted call moves them to the device
        # far cheaper than eager jnp.asarray calls).
        n = max(MIN_ADMIT, len(rows))
        rows, fresh = _padded(rows, n, np.int32), _padded(fresh, n, bool)
        slots = _padded(slots, n, np.int32, fill=self.max_slots)
        values = {name: _padded(values[name], n, dtype) for name, dtype in SLOT_FIELDS.items()}
        k_rows, v_rows, tokens, out = self._first_tokens(k_new, v_new, logits, rows, values,
                                                         fresh, filtered=filtered)
        self.k_cache, self.v_cache = self._install_kv(self.k_cache, self.v_cache, k_rows,
                                                      v_rows, slots)
        self.state = self._install_state(self.state, slots, values, fresh, tokens)
        return out

    def decode(self, weights: dict[str, Any], batch: int, kv_needed: int, filtered: bool,
               kv_horizon: int = 0, steps: int = 1):
        """One decode step of slots ``0..batch-1`` whose next positions are ``< kv_needed``;
        returns the packed ``[3, batch]`` sampled tokens and log-probs (see ``sampling.unpack``).
        With ``steps > 1``, that many steps in one program (``decode.decode_many``; the cache holds
        the positions all of them write), returning ``[steps, 3, batch]``.

        ``kv_horizon`` is how many positions the running sequences may reach: when it exceeds
        the cache length, the step for the next length is compiled in a background thread, so
        that growing into it need not stall decoding for a compilation.
        """
        length = kv_bucket(kv_needed + steps - 1, self.max_seq_len)
        # Grow when needed; shrink only to half or less (each resize copies the cache).
        if length > self.kv_len or 2 * length <= self.kv_len:
            ahead = self._compiling.pop((batch, length, filtered, steps), None)
            if ahead is not None:
                ahead.wait()  # finishing it is faster than compiling again
            self._resize(length)
        self._compiled.add((batch, self.kv_len, filtered, steps))
        program, static = self._decode_program(steps)
        self.k_cache, self.v_cache, self.state, out = program(
            weights, self.k_cache, self.v_cache, self.state, batch=batch, filtered=filtered,
            **static)
        if kv_horizon > self.kv_len:
            self._compile_ahead(weights, batch, kv_bucket(self.kv_len + 1, self.max_seq_len),
                                filtered, steps)
        return out

    def move(self, src: np.ndarray, dst: np.ndarray):
        """Moves the sequences of slots ``src`` into the free slots ``dst`` (see
        ``kv_cache.move_slots``), so that the running ones fit a smaller decode batch."""
        n = self._move_pairs(len(src))
        s, d = np.zeros(n, np.int32), np.full(n, self.max_slots, np.int32)
        s[:len(src)], d[:len(dst)] = src, dst
        self.k_cache, self.v_cache, self.state = self._move(
            self.k_cache, self.v_cache, self.state, s, d)

    def compile_move(self, length: int):
        """Compiles :meth:`move` for caches of ``length`` positions (without running it)."""
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        index = jax.ShapeDtypeStruct((self._move_pairs(1),), jnp.int32)
        self._move.lower(*self._cache_structs(length), jax.tree.map(abstract, self.state),
                         index, index).compile()

    def compile_shrinks(self, lengths) -> int:
        """Compiles every cache resize a decode step may shrink by between ``lengths`` (to half
        the length or less; growing is compiled ahead as the sequences approach it), without
        running them; returns how many."""
        lengths = sorted(set(lengths))
        count = 0
        for longer in lengths:
            current = self._cache_structs(longer)
            for shorter in lengths:
                if 2 * shorter <= longer:
                    self._resizer(shorter).lower(*current).compile()
                    count += 1
        return count

    def _move_pairs(self, pairs: int) -> int:
        """Pairs a move of ``pairs`` sequences is padded to: half the slots (a compaction moves
        at most that many: the sequences above the smaller batch, no more than fit below it;
        each padding pair reads a slot), else all of them."""
        half = max(self.max_slots // 2, 1)
        return half if pairs <= half else self.max_slots

    def _decode_program(self, steps: int):
        """The jitted decode of ``steps`` steps and its extra static arguments."""
        return (self._decode, {}) if steps == 1 else (self._decode_many, {"steps": steps})

    def compile_decode(self, weights, batch: int, length: int, filtered: bool,
                       steps: int = 1) -> bool:
        """Compiles, in the calling thread, the decode program of ``steps`` steps for
        ``batch`` slots over caches of ``length`` positions, without running it (JAX's
        compilation cache then serves its first call); False when it was compiled or under way
        already."""
        key = (batch, length, filtered, steps)
        with self._compile_lock:
            if key in self._compiled:
                return False
            self._compiled.add(key)
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        program, static = self._decode_program(steps)
        program.lower(jax.tree.map(abstract, weights), *self._cache_structs(length),
                      jax.tree.map(abstract, self.state), batch=batch, filtered=filtered,
                      **static).compile()
        return True

    def _compile_ahead(self, weights, batch: int, length: int, filtered: bool, steps: int = 1):
        """Compiles, in a background thread, the decode step (of ``steps`` steps) for caches of
        ``length`` positions and the resize to it (JAX's compilation cache then serves the
        first real call)."""
        key = (batch, length, filtered, steps)
        with self._compile_lock:
            if key in self._compiled:
                return
            self._compiled.add(key)
        done = self._compiling[key] = threading.Event()
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        current = jax.tree.map(abstract, (self.k_cache, self.v_cache))
        args = (jax.tree.map(abstract, weights), *self._cache_structs(length),
                jax.tree.map(abstract, self.state))
        resizer = self._resizer(length)

        def compile_both():
            try:
                resizer.lower(*current).compile()
                program, static = self._decode_program(steps)
                program.lower(*args, batch=batch, filtered=filtered, **static).compile()
            except Exception:  # a missed warm-up only costs the compilation later
                log.debug("compiling the decode step ahead failed", exc_info=True)
            finally:
                done.set()

        # Not a daemon: the interpreter waits for it at exit rather than killing it inside XLA.
        threading.Thread(target=compile_both, name="decode-compile", daemon=False).start()

    def reset_cache(self):
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, self.max_seq_len))
        self.state = self._initial_state()

    # ---- layouts ------------------------------------------------------------------------------

    def _sharding(self, axes, shape, name):
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return self.rules.sharding(self.mesh, axes, shape, name=name)

    def _weight_shardings(self):
        return jax.tree.map(lambda axes: self.rules.sharding(self.mesh, axes),
                            decode_weight_axes(self.config),
                            is_leaf=lambda x: isinstance(x, tuple) and all(
                                a is None or isinstance(a, str) for a in x))

    def _initial_state(self) -> SlotState:
        s = self.max_slots
        return {name: jax.device_put(np.zeros((s,), dtype), self._state_sharding)
                for name, dtype in SLOT_FIELDS.items()}

    def _cache_structs(self, length: int):
        """``(k_cache, v_cache)`` of ``length`` positions as shape/dtype/sharding structures:
        per layer, per slot chunk (``kv_cache.slot_chunks``), keys ``[n, K, Dh, length]`` and values
        ``[n, K, length, Dh]``."""
        k, hd = self.config.num_kv_heads, self.config.head_dim

        def chunks(axes, shape_of, name):
            return tuple(jax.ShapeDtypeStruct(
                shape_of(stop - start), self.cache_dtype,
                sharding=self._sharding(axes, shape_of(stop - start), name))
                for start, stop in slot_chunks(self.max_slots))

        keys = chunks(K_CACHE_AXES, lambda n: (n, k, hd, length), "key cache")
        values = chunks(V_CACHE_AXES, lambda n: (n, k, length, hd), "value cache")
        layers = self.config.num_layers
        return (keys,) * layers, (values,) * layers

    def _zero_cache(self, length: int):
        if length not in self._zeros:
            structs = self._cache_structs(length)
            self._zeros[length] = jax.jit(
                lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), structs),
                out_shardings=jax.tree.map(lambda x: x.sharding, structs))
        return self._zeros[length]()

    def _resizer(self, length: int):
        if length not in self._resizers:
            self._resizers[length] = jax.jit(  # no donation: the shapes differ
                partial(resize_cache, length=length),
                out_shardings=jax.tree.map(lambda x: x.sharding, self._cache_structs(length)))
        return self._resizers[length]

    def _resize(self, length: int):
        """Pads or truncates every layer's cache to ``length`` positions (copies the cache)."""
        self.k_cache, self.v_cache = self._resizer(length)(self.k_cache, self.v_cache)
