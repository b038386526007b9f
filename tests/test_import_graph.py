"""The package layering of rl_jax (tools/import_graph.py): no upward edge, no package cycle; and
the size of its modules: none over MAX_MODULE_LINES lines without a stated reason."""

import ast
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


# ---- module size ------------------------------------------------------------------------------

MAX_MODULE_LINES = 500
LONG_MODULE_MARKER = "Long module:"


def long_modules_without_reason(root: Path) -> list[str]:
    """``path (N lines)`` of every module under ``root/rl_jax`` longer than
    :data:`MAX_MODULE_LINES` whose module docstring has no line starting with
    :data:`LONG_MODULE_MARKER` followed by a reason."""
    found = []
    for path in sorted((root / "rl_jax").rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines <= MAX_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
        reasons = [line.strip()[len(LONG_MODULE_MARKER):].strip() for line in doc.splitlines()
                   if line.strip().startswith(LONG_MODULE_MARKER)]
        if not any(reasons):
            found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_no_module_is_long_without_saying_why():
    """A module of rl_jax has at most MAX_MODULE_LINES (500) lines; a longer one must say why in
    its module docstring, on a line of its own that starts with ``Long module:`` and gives the
    reason (e.g. ``Long module: the N endpoint handlers share one request lifecycle.``). Split
    by concern instead where there is a seam."""
    assert long_modules_without_reason(ROOT) == []


def test_the_size_check_sees_long_modules(tmp_path):
    body = "x = 1\n" * MAX_MODULE_LINES
    _write(tmp_path, {
        "rl_jax/__init__.py": "",
        "rl_jax/short.py": '"""Short."""\n' + "x = 1\n" * (MAX_MODULE_LINES - 1),
        "rl_jax/pkg/long.py": '"""Long, and silent about it."""\n' + body,
        "rl_jax/pkg/marker_only.py": '"""Says nothing.\n\nLong module:\n"""\n' + body,
        "rl_jax/pkg/explained.py": '"""Long.\n\nLong module: one table, read whole.\n"""\n'
                                   + body,
        "rl_jax/pkg/comment.py": '# Long module: a comment is not the docstring\n' + body,
    })
    assert long_modules_without_reason(tmp_path) == [
        f"rl_jax/pkg/comment.py ({MAX_MODULE_LINES + 1} lines)",
        f"rl_jax/pkg/long.py ({MAX_MODULE_LINES + 1} lines)",
        f"rl_jax/pkg/marker_only.py ({MAX_MODULE_LINES + 4} lines)"]


# ---- inside the packages: sub-layers, cycles, one home per name ------------------------------

def test_subpackages_import_only_down_their_layers_and_modules_form_no_cycle():
    edges = import_graph.collect()
    assert ("rl_jax.generator.server.app", "rl_jax.generator.engine.core") in edges
    assert import_graph.sublayer_edges(edges) == []
    assert import_graph.cycles(edges) == []


def test_an_engine_importing_the_server_or_a_puller_the_publisher_is_found(tmp_path):
    _write(tmp_path, {
        "rl_jax/__init__.py": "",
        "rl_jax/generator/__init__.py": "",
        "rl_jax/generator/types.py": "",
        "rl_jax/generator/engine/__init__.py": "",
        "rl_jax/generator/engine/core.py": "from rl_jax.generator.types import X\n"
                                           "def f():\n    from rl_jax.generator.server import app\n",
        "rl_jax/generator/server/__init__.py": "",
        "rl_jax/generator/server/app.py": "from rl_jax.generator.engine import core\n",
        "rl_jax/generator/client/__init__.py": "",
        "rl_jax/generator/client/core.py": "from rl_jax.generator.engine.core import f\n",
        "rl_jax/generator/gadgets/__init__.py": "",
        "rl_jax/generator/gadgets/a.py": "from rl_jax.generator import types\n",
        "rl_jax/transfer/__init__.py": "",
        "rl_jax/transfer/publisher/__init__.py": "",
        "rl_jax/transfer/publisher/core.py": "",
        "rl_jax/transfer/puller/__init__.py": "",
        "rl_jax/transfer/puller/core.py": "import rl_jax.transfer.publisher.core\n",
    })
    found = import_graph.sublayer_edges(import_graph.collect(tmp_path))
    assert found == [
        "rl_jax.generator.client.core -> rl_jax.generator.engine.core (client -> engine, module)",
        "rl_jax.generator.engine.core -> rl_jax.generator.server (engine -> server, function)",
        "rl_jax.generator.engine.core -> rl_jax.generator.server.app (engine -> server, function)",
        "rl_jax.generator.gadgets.a -> rl_jax.generator (subpackage 'gadgets' is not in "
        "SUBLAYERS['generator'])",
        "rl_jax.generator.gadgets.a -> rl_jax.generator.types (subpackage 'gadgets' is not in "
        "SUBLAYERS['generator'])",
        "rl_jax.transfer.puller.core -> rl_jax.transfer.publisher.core (puller -> publisher, "
        "module)",
    ]


def test_every_project_name_is_imported_from_its_one_home():
    files = import_graph.project_files()
    assert ROOT / "tests" / "test_import_graph.py" in files
    assert import_graph.imports_from_elsewhere(files) == []
    assert import_graph.re_exports() == []


def test_a_name_imported_through_a_second_home_is_found(tmp_path):
    _write(tmp_path, {
        "rl_jax/__init__.py": "",
        "rl_jax/envs/__init__.py": "from rl_jax.envs.base import Environment\n",
        "rl_jax/envs/base.py": "class Environment: ...\nLIMIT = 3\n",
        "rl_jax/envs/math.py": "from rl_jax.envs.base import Environment, LIMIT\n"
                               "class MathEnv(Environment):\n    pass\n",
        "tests/test_x.py": "from rl_jax.envs import Environment, base\n"
                           "from rl_jax.envs.math import MathEnv, Missing\n",
    })
    found = import_graph.imports_from_elsewhere(import_graph.project_files(tmp_path), tmp_path)
    assert found == [
        "tests/test_x.py:1: from rl_jax.envs import Environment (defined in rl_jax.envs.base)",
        "tests/test_x.py:2: from rl_jax.envs.math import Missing (undefined)",
    ]
    assert import_graph.re_exports(tmp_path) == [
        "rl_jax/envs/__init__.py:1: Environment (from rl_jax.envs.base)",
        "rl_jax/envs/math.py:1: LIMIT (from rl_jax.envs.base)",
    ]
