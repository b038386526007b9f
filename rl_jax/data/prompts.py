"""The prompt record shared by prompt sources, environments and rollouts.

A :class:`Prompt` is data: the text given to the policy and what is needed to judge completions
of it. Sources (:mod:`rl_jax.data.sources`) produce prompts; environments (:mod:`rl_jax.envs`)
score completions of them. Both depend on this module, and it depends on neither, so that
``data`` stays below ``envs`` (``tools/import_graph.py`` checks the direction).

:class:`PromptGenerator` is the part of an environment that a source needs: prompts generated
deterministically from ``(config, split, index)``. :class:`rl_jax.envs.base.Environment` derives
from it; an environment that does not override :meth:`PromptGenerator.prompt` has no prompts of
its own.

This module imports only the standard library: it is loaded by every environment, including in
the spawned worker processes of the math environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt and what is needed to judge completions of it.

    Attributes:
      text: the text given to the policy.
      answer: the reference answer, if the task has one (e.g. ``"975"``, ``"\\frac{1}{2}"``).
      info: task data the environment reads (numbers and target, unit tests, operands).
      index: the example index within its split, for generated prompts.
      split: ``"train"`` or ``"eval"`` for generated prompts.
    """

    text: str
    answer: str | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    index: int | None = None
    split: str | None = None


class PromptGenerator:
    """Something that may generate its own prompts (an environment's generated tasks)."""

    def prompt(self, index: int, split: str = "train") -> Prompt:
        """Prompt ``index`` of ``split``; a pure function of the generator's config."""
        raise NotImplementedError(f"{type(self).__name__} does not generate prompts; build "
                                  "Prompt objects from your data set")
