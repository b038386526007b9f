"""Error types that describe bad user input (configs, checkpoints, meshes).

Entry points print these as one line instead of a traceback.
"""

from rl_jax.compile_cache import CacheDirError
from rl_jax.losses import GroupSizeError, LossConfigError
from rl_jax.models.config import ConfigError
from rl_jax.models.hf import CheckpointError
from rl_jax.orchestrator.config import RLConfigError
from rl_jax.sharding import ShardingError
from rl_jax.trainer.checkpoint import CheckpointRestoreError
from rl_jax.trainer.lm import RecipeConfigError

USER_ERRORS = (ConfigError, CheckpointError, ShardingError, CheckpointRestoreError,
               RecipeConfigError, LossConfigError, GroupSizeError, RLConfigError, CacheDirError)
