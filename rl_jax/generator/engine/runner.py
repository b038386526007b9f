"""The inference engine's compiled device work for one model: :class:`ModelRunner`.

A runner owns a paged KV cache (:mod:`rl_jax.generator.engine.kv_cache`: its page pool, sized once,
its page table on the host, admission and slot moves), the per-slot decode state and the jitted
programs over them: prefill and decode steps of the decode-path model
(:mod:`rl_jax.generator.engine.decode`) with sampling (:mod:`rl_jax.generator.engine.sampling`), and
the
decode attention backend (:mod:`rl_jax.generator.engine.kernels`). Steps chain on the device: the
host
dispatches step ``t+1`` before it reads the tokens of step ``t``; each step takes its batch's
page table rows from the host (the engine gives a sequence its next page before the step that
writes there is dispatched).
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

from rl_jax.generator.engine import kernels
from rl_jax.generator.engine.decode import (decode, decode_many, decode_weight_axes, prefill,
                                            prepare_decode_weights)
from rl_jax.generator.engine.kv_cache import (DEFAULT_PAGE_SIZE, K_CACHE_AXES, MIN_ADMIT,
                                              SLOT_FIELDS, V_CACHE_AXES, PageTable, SlotState,
                                              first_tokens, install_kv, install_state, kv_bucket,
                                              move_state, pages_for)
from rl_jax.generator.engine.weights import generator_rules
from rl_jax.generator.types import GeneratorError
from rl_jax.models import fused_attention
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

    Args:
      page_size: positions per page of the cache.
      num_pages: pages in the pool (the cache's memory: :attr:`cache_bytes`); by default
        enough for every slot to hold ``max_seq_len`` positions.
    """

    def __init__(self, config: ModelConfig, *, max_slots: int, max_seq_len: int,
                 mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 dtype: Any = jnp.float32, cache_dtype: Any = None, attention: str = "auto",
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 prefill_attention: str = "auto"):
        if page_size < 1:
            raise GeneratorError(f"page_size must be >= 1, got {page_size}")
        if num_pages is not None and num_pages < 1:
            raise GeneratorError(f"num_pages must be >= 1, got {num_pages}")
        self.config = config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.page_size = page_size
        self.num_pages = num_pages or max_slots * pages_for(max_seq_len, page_size)
        self.pages = PageTable(self.num_pages, page_size, max_slots, max_seq_len)
        self.mesh = mesh
        self.rules = rules or generator_rules()
        self.dtype = dtype
        self.cache_dtype = cache_dtype or dtype
        constrain = None
        if mesh is not None:
            constrain = partial(self.rules.constrain, mesh=mesh)
            constrain = (lambda x, axes, _c=constrain: _c(x, logical_axes=axes))
        self.cache_bytes = self.page_bytes(config, page_size, self.cache_dtype) * self.num_pages
        self._zeros = None
        # decode programs (batch, positions of their table width, filtered, steps) compiled or
        # under way
        self._compiled: set[tuple[int, int, bool, int]] = set()
        self._compile_lock = threading.Lock()  # the warm-up compiles beside the scheduler
        self._compiling: dict[tuple[int, int, bool, int], threading.Event] = {}  # ahead
        self._width = 1  # page table columns the last decode step took
        self.k_cache, self.v_cache = self._zero_cache()
        self._state_sharding = self._sharding(("act_batch",), (max_slots,), "slot state")
        self.state = self._initial_state()
        kw = dict(cfg=config, dtype=dtype, constrain=constrain)
        # the decode attention: "native" (the CPU kernel), "pallas" or "xla" (attend)
        self.attention_backend = self._choose_attention(attention)
        self.native_attention = self.attention_backend == "native"
        # the kernels read each slot's pages up to its own position: one page table width
        self.reads_own_length = self.attention_backend in ("native", "pallas")
        # the prefill attention: what prompts of a fused kernel's block length run on
        self.prefill_attention_backend = self._choose_prefill_attention(prefill_attention)
        self._prefill = jax.jit(partial(
            prefill, attention_impl="xla" if self.prefill_attention_backend == "xla" else "auto",
            num_devices=len(self._devices()), **kw))
        kw["attention"] = self._attention_kernel()
        self._decode = jax.jit(partial(decode, max_seq_len=max_seq_len, **kw),
                               static_argnames=("batch", "filtered"), donate_argnums=(1, 2, 3))
        self._decode_many = jax.jit(partial(decode_many, max_seq_len=max_seq_len, **kw),
                                    static_argnames=("steps", "batch", "filtered"),
                                    donate_argnums=(1, 2, 3))
        self._first_tokens = jax.jit(first_tokens, static_argnames=("filtered",))
        self._install_kv = jax.jit(install_kv, donate_argnums=(0, 1))
        self._install_state = jax.jit(install_state, donate_argnums=(0,))
        self._move = jax.jit(move_state, donate_argnums=(0,))
        prepare_kw = {} if mesh is None else {"out_shardings": self._weight_shardings()}
        self._prepare = jax.jit(partial(prepare_decode_weights, cfg=config, dtype=dtype),
                                **prepare_kw)

    @staticmethod
    def page_bytes(config: ModelConfig, page_size: int, cache_dtype: Any) -> int:
        """Bytes of one page of the cache: keys and values of ``page_size`` positions in every
        layer."""
        return (2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim
                * jnp.dtype(cache_dtype).itemsize)

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

    def _choose_prefill_attention(self, requested: str) -> str:
        """The prompts' attention kernel (:mod:`rl_jax.models.fused_attention`): ``"xla"``, or
        ``"auto"``/a named fused kernel, checked here against the backend, dtype and heads and
        compiled once (``"auto"`` falls back to XLA with one log line; a named kernel that
        cannot run is an error naming why). The fused kernel takes each prefill bucket it fits
        (splash: multiples of 128 tokens, one device); other buckets run on XLA."""
        try:
            fused_attention.check_implementation(requested)
            chosen = fused_attention.select_implementation(
                requested, backend=fused_attention.current_backend(), dtype=self.dtype,
                head_dim=self.config.head_dim, q_len=fused_attention.SPLASH_BLOCK,
                kv_len=fused_attention.SPLASH_BLOCK, causal_self=True, has_segment_ids=True,
                num_devices=len(self._devices()))
        except ValueError as e:
            raise GeneratorError(f"prefill attention: {e}") from None
        if chosen == "xla":
            return chosen
        problem = fused_attention.compile_problem(
            chosen, dtype=self.dtype, heads=self.config.num_heads,
            kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim)
        if problem and requested == "auto":
            log.warning("%s prefill attention does not compile here, using XLA's: %s", chosen,
                        problem)
            return "xla"
        if problem:
            raise GeneratorError(f"prefill attention {chosen!r} does not compile here: {problem}")
        return chosen

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
            platform=platform, page_size=self.page_size)

    def _attention_kernel(self):
        """The paged decode attention of :attr:`attention_backend` (``None``:
        ``decode.attend_pages`` over ``decode.attend``). Both kernels read each slot's pages in
        place through its page table."""
        if self.attention_backend == "native":
            return kernels.paged_decode_attention
        if self.attention_backend == "pallas":
            platform = self._devices()[0].platform
            return partial(kernels.pallas_paged_decode_attention, interpret=platform == "cpu",
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
        """Positions the last decode step's attention could read: its page table columns times
        the page size (the whole table for the native and Pallas kernels, which read each slot's
        own length; the pages of the longest sequence's bucket, ``kv_cache.kv_bucket``, for
        XLA's attention, which reads every page it is given)."""
        return self._width * self.page_size

    def _table_width(self, kv_needed: int) -> int:
        """Page table columns a decode step takes when its positions are ``< kv_needed``."""
        if self.reads_own_length:
            return self.pages.width
        return min(pages_for(kv_bucket(kv_needed, self.max_seq_len), self.page_size),
                   self.pages.width)

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
        """Installs prefilled sequences (see ``kv_cache.admit``) in their slots, which hold no
        pages yet, giving each the pages of its prompt (``values["position"]`` positions):
        sequences of one prefill row share the pages their prompt fills, and each takes its
        own from the prompt's last, partly filled one on (:meth:`admission_pages` counts them;
        :class:`GeneratorError` where the free pages do not suffice, nothing taken). Returns the
        packed ``[3, M]`` first tokens and log-probs (meaningful where ``fresh``)."""
        pages = self._take_prompt_pages(np.asarray(rows), np.asarray(slots),
                                        np.asarray(values["position"]),
                                        pages_for(k_new.shape[2], self.page_size))
        # At least MIN_ADMIT rows (padding goes to a dropped slot): fewer programs to compile.
        # Host arrays go to the programs as they are (the jitted call moves them to the device
        # far cheaper than eager jnp.asarray calls).
        n = max(MIN_ADMIT, len(rows))
        rows, fresh = _padded(rows, n, np.int32), _padded(fresh, n, bool)
        slots = _padded(slots, n, np.int32, fill=self.max_slots)
        if len(pages) < n:
            pages = np.concatenate([pages, np.full((n - len(pages), pages.shape[1]),
                                                   self.num_pages, np.int32)])
        values = {name: _padded(values[name], n, dtype) for name, dtype in SLOT_FIELDS.items()}
        k_rows, v_rows, tokens, out = self._first_tokens(k_new, v_new, logits, rows, values,
                                                         fresh, filtered=filtered)
        self.k_cache, self.v_cache = self._install_kv(self.k_cache, self.v_cache, k_rows,
                                                      v_rows, pages)
        self.state = self._install_state(self.state, slots, values, fresh, tokens)
        return out

    def admission_pages(self, lengths: list[int], samples: list[int]) -> int:
        """Free pages an admission of prompts of ``lengths`` positions with ``samples`` sequences
        each takes (:meth:`admit`): each prompt's pages once, and one more per further sample
        where the prompt ends inside a page."""
        size = self.page_size
        return sum(pages_for(n, size) + (k - 1) * (n % size != 0)
                   for n, k in zip(lengths, samples))

    def _take_prompt_pages(self, rows: np.ndarray, slots: np.ndarray, lengths: np.ndarray,
                           columns: int) -> np.ndarray:
        """Gives the admitted sequences their prompt pages (see :meth:`admit`); returns the
        ``[M, columns]`` pages their prefill positions are written to (the pool's size where
        nothing is: past a prompt, pages another sample of its row writes, padding)."""
        table, size = self.pages, self.page_size
        live = [i for i in range(len(slots)) if slots[i] < self.max_slots]
        groups: dict[int, list[int]] = {}  # prefill row -> [prompt positions, sequences]
        for i in live:
            groups.setdefault(int(rows[i]), [int(lengths[i]), 0])[1] += 1
        wanted = self.admission_pages([g[0] for g in groups.values()],
                                      [g[1] for g in groups.values()])
        if wanted > table.free_pages:
            raise GeneratorError(f"the admission needs {wanted} KV-cache pages, "
                                 f"{table.free_pages} are free")
        dest = np.full((len(slots), columns), self.num_pages, np.int32)
        first: dict[int, int] = {}
        for i in live:
            slot, length = int(slots[i]), int(lengths[i])
            shared, row = 0, int(rows[i])
            if row in first:
                shared = length // size
                table.share(first[row], slot, shared)
            else:
                first[row] = slot
            table.grow(slot, length)
            held = min(int(table.held[slot]), columns)
            dest[i, shared:held] = table.table[slot, shared:held]
        return dest

    def decode(self, weights: dict[str, Any], batch: int, kv_needed: int, filtered: bool,
               kv_horizon: int = 0, steps: int = 1):
        """One decode step of slots ``0..batch-1`` whose next positions are ``< kv_needed``;
        returns the packed ``[3, batch]`` sampled tokens and log-probs (see ``sampling.unpack``).
        With ``steps > 1``, that many steps in one program (``decode.decode_many``), returning
        ``[steps, 3, batch]``. The slots must hold the pages of the positions the steps write
        (:attr:`pages`; a write where a slot holds no page is dropped).

        For attentions that read every page they are given (not the native kernel), the step
        takes the page table columns of the longest sequence's bucket
        (``kv_cache.kv_bucket``), one compiled program per width; ``kv_horizon`` is how many
        positions the running sequences may reach: when it exceeds the current width, the step
        for the next one is compiled in a background thread, so that growing into it need not
        stall decoding for a compilation.
        """
        width = self._table_width(kv_needed + steps - 1)
        key = (batch, width * self.page_size, filtered, steps)
        ahead = self._compiling.pop(key, None)
        if ahead is not None:
            ahead.wait()  # finishing it is faster than compiling again
        self._compiled.add(key)
        self._width = width
        program, static = self._decode_program(steps)
        table = self.pages.table[:batch, :width].copy()  # the host table changes later
        self.k_cache, self.v_cache, self.state, out = program(
            weights, self.k_cache, self.v_cache, self.state, table, batch=batch,
            filtered=filtered, **static)
        if not self.reads_own_length and kv_horizon > width * self.page_size:
            self._compile_ahead(weights, batch, self._table_width(width * self.page_size + 1),
                                filtered, steps)
        return out

    def move(self, src: np.ndarray, dst: np.ndarray):
        """Moves the sequences of slots ``src`` into the free slots ``dst`` (their page table
        rows and slot state, ``kv_cache.move_state``), so that the running ones fit a smaller
        decode batch."""
        for a, b in zip(src.tolist(), dst.tolist()):
            self.pages.move(a, b)
        n = self._move_pairs(len(src))
        s, d = np.zeros(n, np.int32), np.full(n, self.max_slots, np.int32)
        s[:len(src)], d[:len(dst)] = src, dst
        self.state = self._move(self.state, s, d)

    def compile_move(self):
        """Compiles :meth:`move` (without running it)."""
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        index = jax.ShapeDtypeStruct((self._move_pairs(1),), jnp.int32)
        self._move.lower(jax.tree.map(abstract, self.state), index, index).compile()

    def _move_pairs(self, pairs: int) -> int:
        """Pairs a move of ``pairs`` sequences is padded to: half the slots (a compaction moves
        at most that many: the sequences above the smaller batch, no more than fit below it;
        each padding pair reads a slot), else all of them."""
        half = max(self.max_slots // 2, 1)
        return half if pairs <= half else self.max_slots

    def _decode_program(self, steps: int):
        """The jitted decode of ``steps`` steps and its extra static arguments."""
        return (self._decode, {}) if steps == 1 else (self._decode_many, {"steps": steps})

    def decode_widths(self, max_seq_len: int | None = None) -> list[int]:
        """The page table widths decode steps take for sequences up to ``max_seq_len``
        positions (default the runner's): one with the native kernel (it reads each slot's
        pages up to its position), else one per cache-length bucket."""
        limit = self.max_seq_len if max_seq_len is None else max_seq_len
        return sorted({self._table_width(n) for n in range(1, limit + 1)})

    def compile_decode(self, weights, batch: int, width: int, filtered: bool,
                       steps: int = 1) -> bool:
        """Compiles, in the calling thread, the decode program of ``steps`` steps for ``batch``
        slots over ``width`` page table columns, without running it (JAX's compilation cache
        then serves its first call); False when it was compiled or under way already."""
        key = (batch, width * self.page_size, filtered, steps)
        with self._compile_lock:
            if key in self._compiled:
                return False
            self._compiled.add(key)
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        program, static = self._decode_program(steps)
        program.lower(jax.tree.map(abstract, weights), *self._cache_structs(),
                      jax.tree.map(abstract, self.state),
                      jax.ShapeDtypeStruct((batch, width), jnp.int32), batch=batch,
                      filtered=filtered, **static).compile()
        return True

    def _compile_ahead(self, weights, batch: int, width: int, filtered: bool, steps: int = 1):
        """Compiles, in a background thread, the decode step (of ``steps`` steps) over ``width``
        page table columns (JAX's compilation cache then serves the first real call)."""
        key = (batch, width * self.page_size, filtered, steps)
        with self._compile_lock:
            if key in self._compiled:
                return
            self._compiled.add(key)
        done = self._compiling[key] = threading.Event()
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        args = (jax.tree.map(abstract, weights), *self._cache_structs(),
                jax.tree.map(abstract, self.state),
                jax.ShapeDtypeStruct((batch, width), jnp.int32))

        def compile_step():
            try:
                program, static = self._decode_program(steps)
                program.lower(*args, batch=batch, filtered=filtered, **static).compile()
            except Exception:  # a missed warm-up only costs the compilation later
                log.debug("compiling the decode step ahead failed", exc_info=True)
            finally:
                done.set()

        # Not a daemon: the interpreter waits for it at exit rather than killing it inside XLA.
        threading.Thread(target=compile_step, name="decode-compile", daemon=False).start()

    def reset_cache(self):
        """Zeroes the cache and the slot state; every page is free again."""
        self.k_cache, self.v_cache = self._zero_cache()
        self.pages.reset()
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

    def _cache_structs(self):
        """``(k_cache, v_cache)`` as shape/dtype/sharding structures: per layer, the page pools
        of keys ``[N, K, Dh, P]`` and values ``[N, K, P, Dh]`` (``kv_cache``)."""
        k, hd, n, p = (self.config.num_kv_heads, self.config.head_dim, self.num_pages,
                       self.page_size)

        def pool(axes, shape, name):
            return jax.ShapeDtypeStruct(shape, self.cache_dtype,
                                        sharding=self._sharding(axes, shape, name))

        layers = self.config.num_layers
        return ((pool(K_CACHE_AXES, (n, k, hd, p), "key cache"),) * layers,
                (pool(V_CACHE_AXES, (n, k, p, hd), "value cache"),) * layers)

    def _zero_cache(self):
        if self._zeros is None:
            structs = self._cache_structs()
            self._zeros = jax.jit(
                lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), structs),
                out_shardings=jax.tree.map(lambda x: x.sharding, structs))
        return self._zeros()
