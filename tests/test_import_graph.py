"""The package layering of rl_jax (tools/import_graph.py): no upward edge, no package cycle."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_rl_jax_imports_point_down_the_layers():
    edges = import_graph.collect()
    folded = import_graph.package_edges(edges)
    assert ("envs", "data") in folded  # the scan sees real edges
    upward = {edge: sorted(f"{s} -> {t}" for (s, t) in edges
                           if (import_graph.package_of(s), import_graph.package_of(t)) == edge)
              for edge in import_graph.upward_edges(folded)}
    assert upward == {}
    assert import_graph.cycles(folded) == []
    packages = {p for edge in folded for p in edge}
    assert [p for p in packages if import_graph.layer_of(p) is None] == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_function_level_and_registry_imports_are_edges(tmp_path):
    _write(tmp_path, {
        "rl_jax/__init__.py": "",
        "rl_jax/data/__init__.py": "",
        "rl_jax/data/sources.py": "def f():\n    from rl_jax.envs.base import Environment\n",
        "rl_jax/envs/__init__.py": "_BUILTIN = {'math': 'rl_jax.envs.math:MathEnv'}\n",
        "rl_jax/envs/math.py": "",
        "rl_jax/envs/base.py": "from ..data import sources\n",
    })
    edges = import_graph.collect(tmp_path)
    assert edges[("rl_jax.data.sources", "rl_jax.envs.base")] == {"function"}
    assert edges[("rl_jax.envs", "rl_jax.envs.math")] == {"dynamic"}
    assert edges[("rl_jax.envs.base", "rl_jax.data.sources")] == {"module"}
    folded = import_graph.package_edges(edges)
    assert folded == {("data", "envs"): {"function"}, ("envs", "data"): {"module"}}
    assert import_graph.upward_edges(folded) == [("data", "envs")]
    assert import_graph.cycles(folded) == [["data", "envs"]]
