"""The what-fits-where table (rl_jax.sysmodel.fits) against the memory model it is read from."""

import pytest

from rl_jax.models.shapes import shape as named_shape
from rl_jax.sysmodel.accelerators import CATALOGUE
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.fits import FitSettings, main, serve_bytes, table, train_bytes
from rl_jax.sysmodel.shape import ModelShape

SETTINGS = FitSettings()


def test_each_fit_is_the_fewest_chips_that_fit():
    """The chosen chip count fits within the usable memory and the power of two below it
    does not (or does not split the heads), for training and serving."""
    for f in table(["qwen2.5-0.5b", "qwen3-8b", "llama-3.1-70b"], ["h100", "tpu_v5e"]):
        model = ModelShape.from_model_config(named_shape(f.shape))
        budget = CATALOGUE[f.accelerator].memory_capacity * SETTINGS.memory_fraction
        assert f.train_chips is not None
        assert f.train_bytes == train_bytes(model, f.train_chips, SETTINGS) <= budget
        if f.train_chips > 1:
            assert train_bytes(model, f.train_chips // 2, SETTINGS) > budget
        if f.serve_chips is not None:
            assert f.serve_bytes == serve_bytes(model, f.serve_chips, SETTINGS) <= budget
            below = [serve_bytes(model, n, SETTINGS) for n in (1, 2, 4, 8, 16)
                     if n < f.serve_chips]
            assert all(b is None or b > budget for b in below)


def test_larger_models_need_at_least_as_many_chips():
    fits = {f.shape: f for f in table(["qwen2.5-0.5b", "llama-3.1-8b", "llama-3.1-70b"],
                                      ["h100"])}
    assert fits["qwen2.5-0.5b"].train_chips == 1 == fits["qwen2.5-0.5b"].serve_chips
    assert 1 < fits["llama-3.1-8b"].train_chips < fits["llama-3.1-70b"].train_chips
    assert fits["llama-3.1-8b"].serve_chips <= fits["llama-3.1-70b"].serve_chips
    # 70B in float32 master weights and moments: over a terabyte before activations
    assert fits["llama-3.1-70b"].train_chips >= 16


def test_heads_that_do_not_split_are_not_a_layout():
    model = ModelShape.from_model_config(named_shape("qwen2.5-7b"))  # 28 heads, 4 kv heads
    assert serve_bytes(model, 4, SETTINGS) is not None
    assert serve_bytes(model, 8, SETTINGS) is None


def test_bad_input_is_named():
    with pytest.raises(SysModelError, match="unknown accelerators \\['h1000'\\]"):
        table(["qwen2.5-0.5b"], ["h1000"])
    with pytest.raises(SysModelError, match="seq and slots must be >= 1"):
        table(["qwen2.5-0.5b"], ["h100"], FitSettings(seq=0))
    with pytest.raises(SysModelError, match="memory_fraction"):
        table(["qwen2.5-0.5b"], ["h100"], FitSettings(memory_fraction=1.5))


def test_command_line(capsys):
    assert main(["--shapes=qwen2.5-0.5b,qwen3-8b", "--accelerators=h100,tpu_v6e"]) == 0
    out = capsys.readouterr().out
    assert "| shape | h100 | tpu_v6e |" in out and "| qwen2.5-0.5b | 1 / 1 | 1 / 1 |" in out
    assert main(["--shapes=qwen2.5-0.5b", "--accelerators=nope"]) == 2
    assert "unknown accelerators" in capsys.readouterr().err
