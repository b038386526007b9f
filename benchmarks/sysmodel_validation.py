"""The systems model against published end-to-end RL step times of other systems.

Every case in ``benchmarks/sysmodel_cases.json`` is a figure a system published (its source,
the quoted line, the configuration the source gives). A case with a ``model_inputs`` block is
predicted: the block holds what the model needs and the source does not fix, each with its
reason (``"why"``), so every assumption stands beside the figure it serves. The layout is the
published one (chips, split, tensor parallelism); nothing is fitted to these figures.

    python benchmarks/sysmodel_validation.py            # table, summary, JSON and PNG
    python benchmarks/sysmodel_validation.py --case=ID  # one case, with its parts

Prints predicted / published per case and the spread; writes
``benchmarks/results/sysmodel_validation.json`` and ``.png``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ROOT / "benchmarks" / "sysmodel_cases.json"
MODES = {"split_sync": "sync"}  # the cases' names of the model's modes, where they differ
RESULTS = ROOT / "benchmarks" / "results"

_CASE = flags.DEFINE_string("case", "", "Only this case id (prints its parts).")
_OUT = flags.DEFINE_string("out", "sysmodel_validation", "Results name under benchmarks/results "
                           "('' writes nothing).")


def value(inputs: dict[str, Any], key: str, default: Any = None) -> Any:
    """An input's value: a plain value, or ``{"value": ..., "why": ...}``."""
    item = inputs.get(key, default)
    return item["value"] if isinstance(item, dict) and "value" in item else item


def build_job(case: dict[str, Any]):
    """The :class:`~rl_jax.sysmodel.cluster.RLJob` of a case: its published configuration and
    its ``model_inputs``."""
    from rl_jax.models.shapes import shape as model_config
    from rl_jax.sysmodel.accelerators import get_accelerator
    from rl_jax.sysmodel.cluster import RLJob, TrainerWork, lognormal_with_mean
    from rl_jax.sysmodel.shape import ModelShape

    inputs = case["model_inputs"]
    shape = ModelShape.from_model_config(model_config(value(inputs, "shape")),
                                         name=case["model"])
    prompt_len = float(value(inputs, "prompt_len"))
    max_response = int(value(inputs, "max_response_len", case.get("max_response_len")))
    accelerator = get_accelerator(value(inputs, "accelerator"))
    work = TrainerWork(
        logprob_passes=int(value(inputs, "logprob_passes", 1)),
        reference=bool(value(inputs, "reference", case.get("reference_model") or False)),
        remat=str(value(inputs, "remat", "full")), mfu=float(value(inputs, "mfu", 0.4)),
        model_parallel=int(value(inputs, "model_parallel", 1)),
        tensor_parallel=int(value(inputs, "tensor_parallel", 1)),
        shard_params=bool(value(inputs, "shard_params", True)),
        offload=bool(value(inputs, "offload", False)))
    samples = int(value(inputs, "prompts_per_step", case.get("prompts_per_step"))) * \
        int(value(inputs, "samples_per_prompt", case.get("samples_per_prompt")))
    mean = inputs["mean_response_len"]
    if isinstance(mean, dict) and "logprob_s" in mean:
        # Not published: the tokens a published log-prob pass of the same run took that long
        # for, at the trainer's MFU (the chips and the pass as that run had them).
        tokens = inferred_tokens_per_sample(shape, accelerator, int(mean["chips"]),
                                            float(mean["logprob_s"]), work.mfu, samples)
        mean_response = tokens - prompt_len
    else:
        mean_response = float(value(inputs, "mean_response_len"))
    lengths = lognormal_with_mean(mean_response, float(value(inputs, "length_sigma", 0.8)),
                                  max_response)
    return RLJob(
        shape=shape, accelerator=accelerator,
        mode=MODES.get(case["mode"], case["mode"]), chips=int(case["num_accelerators"]),
        trainer_chips=case.get("trainer_accelerators"),
        generator_chips=case.get("generator_accelerators"),
        prompts_per_step=int(value(inputs, "prompts_per_step", case.get("prompts_per_step"))),
        samples_per_prompt=int(value(inputs, "samples_per_prompt",
                                     case.get("samples_per_prompt"))),
        prompt_len=prompt_len, lengths=lengths, work=work,
        generator_tp=int(value(inputs, "generator_tp", case.get("generator_tp") or 1)),
        engine=str(value(inputs, "engine", "paged")),
        max_running=int(value(inputs, "max_running", 1024)),
        optimizer_steps=int(value(inputs, "optimizer_steps", 1)),
        max_lag=int(value(inputs, "max_lag", 1)))


def inferred_tokens_per_sample(shape, accelerator, chips: int, seconds: float, mfu: float,
                               samples: int, dtype: str = "bfloat16") -> float:
    """Tokens per sample (prompt + response) a forward pass over ``samples`` samples on
    ``chips`` chips at ``mfu`` finishes in ``seconds`` (attention FLOPs at that length)."""
    budget = seconds * chips * accelerator.flops(dtype) * mfu / samples
    tokens = budget / (shape.train_flops_per_token(0) / 3)
    for _ in range(20):  # attention grows with the length: a fixed point
        tokens = budget / (shape.train_flops_per_token(tokens) / 3)
    return tokens


def published_seconds(case: dict[str, Any]) -> float:
    if case["metric"] != "step_time_s":
        raise ValueError(f"case {case['id']}: metric {case['metric']!r} is not modelled")
    return float(case["value"])


def evaluate(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted and published seconds per RL step of every case with model inputs."""
    from rl_jax.sysmodel.cluster import predict_step
    rows = []
    for case in cases:
        if "model_inputs" not in case:
            continue
        prediction = predict_step(build_job(case))
        published = published_seconds(case)
        rows.append({"id": case["id"], "system": case["system"], "model": case["model"],
                     "chips": case["num_accelerators"], "accelerator": case["accelerator"],
                     "mode": case["mode"], "published_s": published,
                     "predicted_s": prediction["step_s"],
                     "ratio": prediction["step_s"] / published,
                     "parts": {k: v for k, v in prediction.items() if k != "step_s"}})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rows]
    errors = [abs(x - 1) for x in ratios]
    return {"cases": len(rows), "systems": sorted({r["system"] for r in rows}),
            "within_25pct": sum(e <= 0.25 for e in errors),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None}


def load_cases() -> list[dict[str, Any]]:
    return json.loads(CASES.read_text())["cases"]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {"colocated": "o", "one_step_off": "s", "async": "^", "split_sync": "D"}
    colors = {system: f"C{i}" for i, system in enumerate(sorted({r["system"] for r in rows}))}
    for r in rows:
        ax.scatter(r["published_s"], r["predicted_s"], marker=markers.get(r["mode"], "x"),
                   color=colors[r["system"]], label=f"{r['system'].split(' (')[0]} {r['mode']}")
    lo = min(min(r["published_s"], r["predicted_s"]) for r in rows) * 0.7
    hi = max(max(r["published_s"], r["predicted_s"]) for r in rows) * 1.3
    for k, style in ((1.0, "-"), (1.25, ":"), (0.75, ":")):
        ax.plot([lo, hi], [lo * k, hi * k], "k" + style, lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="published seconds per RL step", ylabel="predicted",
           title="systems model vs published RL step times (dotted: ±25%)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    cases = load_cases()
    if _CASE.value:
        cases = [c for c in cases if c["id"] == _CASE.value]
        if not cases:
            raise SystemExit(f"no case {_CASE.value!r} in {CASES}")
    rows = evaluate(cases)
    print(f"{'case':44s} {'chips':>5s} {'mode':>12s} {'published':>10s} {'predicted':>10s} "
          f"{'ratio':>6s}")
    for r in rows:
        print(f"{r['id']:44s} {r['chips']:5d} {r['mode']:>12s} {r['published_s']:10.1f} "
              f"{r['predicted_s']:10.1f} {r['ratio']:6.2f}")
        if _CASE.value:
            print(json.dumps(r["parts"], indent=1))
    s = summary(rows)
    print(f"{s['within_25pct']}/{s['cases']} within 25% ({', '.join(s['systems'])}); median "
          f"|error| {s['median_abs_error']:.0%}, max {s['max_abs_error']:.0%}, ratios "
          f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}")
    if _OUT.value and not _CASE.value:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{_OUT.value}.json"
        path.write_text(json.dumps({"summary": s, "rows": rows}, indent=1))
        plot(rows, path.with_suffix(".png"))
        print(f"wrote {path} and .png")


if __name__ == "__main__":
    app.run(main)
