#!/usr/bin/env bash
# Installs the real SGLang server (0.5.23, CPU) into a virtual environment of its own:
#   bash tools/sglang_cpu/install.sh VENV_DIR
# Creates VENV_DIR if it has no bin/python, installs requirements.txt with --no-deps (every
# package pinned; torch is the CPU build that lies on this machine's disk) and copies the
# stand-ins of stubs/ into its site-packages. A stamp in VENV_DIR holds a hash of this script,
# requirements.txt and stubs/: when it matches, nothing is done.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$1"
python="$venv/bin/python"
stamp="$venv/.rl_jax_sglang_cpu.stamp"

# The hash of what this script installs (paths relative to this folder, bytecode caches left out).
hash="$(cd "$here" && find install.sh requirements.txt stubs -type f -not -name '*.pyc' \
    -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"

if [ -x "$python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    echo "SGLang (CPU) is installed in $venv"
    exit 0
fi

if [ -x "$python" ] &&
    "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("rl_jax") is None)'
then
    # SGLang pins other versions of shared packages (tokenizers): never install it beside rl_jax.
    echo "refusing: $venv has rl_jax installed; SGLang needs a virtual environment of its own" >&2
    exit 1
fi

# One install at a time per venv (the lock is a file in the venv's folder).
mkdir -p "$venv"
exec 9>"$venv/.rl_jax_sglang_cpu.lock"
flock 9
if [ -x "$python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
    echo "SGLang (CPU) is installed in $venv"
    exit 0
fi

start=$SECONDS
if [ ! -x "$python" ]; then
    python3 -m venv "$venv"
fi
rm -f "$stamp"

# torch from this machine's disk only (--no-index keeps pip's find-links, /opt/wheels here): the
# CPU build of 2.13.0 lies there, for Python 3.11. From an index it would be a CUDA build of
# several GB, which must never come in.
if ! "$python" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check \
        "$(grep -E '^torch==' "$here/requirements.txt")"; then
    echo "the CPU build of torch (torch==2.13.0, for Python 3.11) is not on this machine's disk;" \
        "not taking a CUDA build from PyPI" >&2
    exit 1
fi

# --no-compile: the bytecode of what the server runs is written below, by importing it (compiling
# every file, most of them never imported, takes longer than the rest of the install).
"$python" -m pip install -q --no-deps --no-compile --disable-pip-version-check \
    -r "$here/requirements.txt"

# The stand-ins (sgl_kernel, triton, torchvision), replacing any earlier copy.
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for package in "$here"/stubs/*/; do
    name="$(basename "$package")"
    rm -rf "${site:?}/$name"
    cp -r "$package" "$site/$name"
    find "$site/$name" -name __pycache__ -type d -prune -exec rm -rf {} +
done

# Checks that torch is the CPU build (a CUDA build, several GB, must never come in) and that the
# server's modules import. Importing them with bytecode writing on also leaves their .pyc files,
# which halve the server's start-up where PYTHONDONTWRITEBYTECODE is set (30 s, not 65 s).
env -u PYTHONDONTWRITEBYTECODE "$python" -W ignore - <<'PY'
import sys

import torch

if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build (CUDA {torch.version.cuda}): "
             "expected the CPU build of torch==2.13.0")
import sgl_kernel, torchvision, triton  # noqa: E401,F401 (the stand-ins)
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.detokenizer_manager  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
import sglang.srt.model_executor.model_runner  # noqa: F401
import sglang.srt.models.llama, sglang.srt.models.qwen2, sglang.srt.models.qwen3  # noqa: E401,F401
print(f"torch {torch.__version__} (CPU build); the server's modules import")
PY

echo "$hash" >"$stamp"
echo "SGLang (CPU) installed in $venv in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
