"""rl_jax: asynchronous reinforcement learning for language models in JAX."""

from setuptools import find_packages, setup

# The JAX stack is pinned to versions known to install and work together on Python 3.11.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "array-record==0.8.6",  # ArrayRecord prompt files (rl_jax.data.sources)
    "pyarrow==26.0.1",  # Parquet prompt files (rl_jax.data.sources)
    "absl-py>=2.1,<3",
    "ml-collections==1.1.0",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
    "numpy>=1.26",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    # Math answer checking (rl_jax.envs.math).
    "sympy==1.14.0",
    # Tool-call arguments checked against each tool's JSON schema (rl_jax.envs.tools).
    "jsonschema>=4.20,<5",
    # Generator HTTP server and client (rl_jax.generator.server.app / client).
    "aiohttp>=3.9,<4",
    # Per-tensor checksums of transferred weights (rl_jax.transfer).
    "xxhash==4.1.0",
    # Compressed weight deltas for slow links (rl_jax.transfer.transports.delta).
    "zstandard==0.25.0",
    # TensorBoard event files of RL runs (rl_jax.orchestrator).
    "tensorboardX==2.6.4",
]

EXTRAS = {
    # torch is pinned to the CPU build; transformers is only a parity reference in tests;
    # pytest-timeout fails a hanging test (see pytest.ini); ray for the Ray launcher's
    # multi-node test (about 26 s to install, a 79 MB wheel); peft loads the LoRA adapters
    # this project exports (tests/test_lora.py; it keeps the pinned torch).
    "test": ["pytest>=8", "pytest-timeout>=2.3,<3", "torch==2.13.0", "transformers==5.23.0",
             "sglang-router==0.3.2", "ray==2.60.0", "peft==0.21.2"],
    # Launching a run on a Ray cluster (launch/ray_launch.py, rl_jax.cluster); Ray's core
    # package only: no dashboard, no CUDA libraries.
    "ray": ["ray==2.60.0"],
    # Real SGLang servers for GPU machines (needs CUDA).
    "sglang": ["sglang[srt]"],
    # The same JAX release with its accelerator plugins (CUDA 12 or 13 wheels, or libtpu).
    "gpu": ["jax[cuda12]==0.10.2"],
    "gpu-cuda13": ["jax[cuda13]==0.10.2"],
    "tpu": ["jax[tpu]==0.10.2"],
}

setup(
    name="rl_jax",
    version="0.1.0",
    description="Asynchronous reinforcement learning for language models in JAX",
    packages=find_packages(include=["rl_jax", "rl_jax.*", "launch", "launch.*"]),
    # Native CPU kernels are compiled on first use (rl_jax.generator.engine.kernels).
    package_data={"rl_jax.generator.engine.kernels": ["*.cc"], "rl_jax.transfer": ["*.c"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
