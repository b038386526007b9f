"""What fits where: for each named shape and accelerator of the catalogue, the fewest chips that
train it and the fewest that serve it, from :mod:`rl_jax.sysmodel.memory`.

    python -m rl_jax.sysmodel.fits [--seq=4096] [--slots=64] [--param_dtype=float32]
        [--remat=full] [--shapes=qwen2.5-0.5b,...] [--accelerators=h100,...]

Training: AdamW with ``param_dtype`` master weights and moments, bfloat16 compute, fused
attention, FSDP over ``n`` chips (``n`` a power of two), one ``seq``-token row per chip per
micro-batch with gradients accumulated over micro-batches (``accumulation="streaming"``, the RL
trainer's ``trainer.micro_batch_rows``). Serving: one generator server in bfloat16, tensor
parallel over ``n`` chips (heads must split: ``n`` divides the key/value heads, or the query heads
when there are fewer key/value heads than chips), ``slots`` sequences of ``seq`` tokens in its KV
cache. A layout fits when its bytes per chip are within ``memory_fraction`` of the chip's memory
(:class:`rl_jax.sysmodel.sweep.SweepOptions`' default, 0.9). The figures are the systems
model's, checked against XLA's compiled peaks on CPU (``tests/test_sysmodel_memory.py``); on an
accelerator the runtime's own reservations come on top.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

from rl_jax.sysmodel.accelerators import CATALOGUE, Accelerator
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.memory import trainer_memory
from rl_jax.sysmodel.memory_serving import generator_memory
from rl_jax.sysmodel.shape import ModelShape

GiB = 2 ** 30
CHIPS = tuple(2 ** i for i in range(11))  # 1 .. 1024


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """The workload the table is for (see the module docstring)."""

    seq: int = 4096
    slots: int = 64
    param_dtype: str = "float32"
    remat: str = "full"
    memory_fraction: float = 0.9

    def validate(self):
        if self.seq < 1 or self.slots < 1:
            raise SysModelError(f"seq and slots must be >= 1, got seq={self.seq}, "
                                f"slots={self.slots}")
        if not 0 < self.memory_fraction <= 1:
            raise SysModelError(f"memory_fraction must be in (0, 1], got "
                                f"{self.memory_fraction}")


@dataclasses.dataclass(frozen=True)
class Fit:
    """The fewest chips for one shape on one accelerator and their bytes per chip (``None``:
    no power of two up to 1024 that fits, for serving also one that splits the heads)."""

    shape: str
    accelerator: str
    train_chips: int | None
    train_bytes: float | None
    serve_chips: int | None
    serve_bytes: float | None


def train_bytes(shape: ModelShape, chips: int, s: FitSettings) -> float:
    """Bytes per chip of the train step with FSDP over ``chips``."""
    return trainer_memory(shape, batch=chips, seq=s.seq, mesh=(1, chips, 1), dtype="bfloat16",
                          param_dtype=s.param_dtype, remat=s.remat, attention="fused",
                          backend="accelerator", accumulation="streaming").total


def serve_bytes(shape: ModelShape, chips: int, s: FitSettings) -> float | None:
    """Bytes per chip of a generator server tensor parallel over ``chips`` (``None`` where the
    heads do not split over them)."""
    heads = shape.num_kv_heads if shape.num_kv_heads >= chips else shape.num_heads
    if heads % chips:
        return None
    return generator_memory(shape, tensor_parallel=chips, max_slots=s.slots,
                            max_seq_len=s.seq, dtype="bfloat16").total


def _fewest(fn, budget: float) -> tuple[int | None, float | None]:
    for chips in CHIPS:
        total = fn(chips)
        if total is not None and total <= budget:
            return chips, total
    return None, None


def fit(name: str, shape: ModelShape, accelerator: Accelerator, s: FitSettings) -> Fit:
    budget = accelerator.memory_capacity * s.memory_fraction
    train = _fewest(lambda n: train_bytes(shape, n, s), budget)
    serve = _fewest(lambda n: serve_bytes(shape, n, s), budget)
    return Fit(name, accelerator.name, *train, *serve)


def table(shapes: Sequence[str], accelerators: Sequence[str],
          settings: FitSettings = FitSettings()) -> list[Fit]:
    """One :class:`Fit` per (shape, accelerator)."""
    from rl_jax.models.shapes import shape as named_shape
    settings.validate()
    unknown = [a for a in accelerators if a not in CATALOGUE]
    if unknown:
        raise SysModelError(f"unknown accelerators {unknown}; the catalogue has "
                            f"{sorted(CATALOGUE)}")
    out = []
    for name in shapes:
        model = ModelShape.from_model_config(named_shape(name))
        out.extend(fit(name, model, CATALOGUE[a], settings) for a in accelerators)
    return out


def markdown(fits: list[Fit], settings: FitSettings) -> str:
    """The table: a row per shape, a column per accelerator, ``train / serve`` chips."""
    names = list(dict.fromkeys(f.shape for f in fits))
    accs = list(dict.fromkeys(f.accelerator for f in fits))
    cell = {(f.shape, f.accelerator): f for f in fits}

    def chips(n, none):
        return none if n is None else str(n)

    lines = [f"Fewest chips to train / to serve ({settings.seq}-token sequences; training: "
             f"AdamW, {settings.param_dtype} master weights, bf16 compute, remat "
             f"{settings.remat}, FSDP; serving: bf16, tensor parallel, {settings.slots} "
             f"sequences in the KV cache; {settings.memory_fraction:.0%} of each chip's "
             f"memory):", "",
             "| shape | " + " | ".join(accs) + " |",
             "|---|" + "---|" * len(accs)]
    for name in names:
        row = [f"{chips(cell[name, a].train_chips, '>1024')} / "
               f"{chips(cell[name, a].serve_chips, '-')}" for a in accs]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += ["", "`-`: no tensor-parallel degree that splits the model's heads fits one server "
              "(serve several smaller KV caches, or fewer sequences each); `>1024`: more than "
              "1,024 chips."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    from rl_jax.models.shapes import shape_names
    p = argparse.ArgumentParser(prog="python -m rl_jax.sysmodel.fits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--param_dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default="full")
    p.add_argument("--shapes", default=",".join(n for n in shape_names()
                                                if n not in ("tiny", "small")))
    p.add_argument("--accelerators", default=",".join(sorted(CATALOGUE)))
    args = p.parse_args(argv)
    settings = FitSettings(seq=args.seq, slots=args.slots, param_dtype=args.param_dtype,
                           remat=args.remat)
    try:
        fits = table(args.shapes.split(","), args.accelerators.split(","), settings)
    except (SysModelError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(fits, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
