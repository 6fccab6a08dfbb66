"""The dependency rules of the design (shared/DESIGN.md, "Dependency rules"): the core
never imports the server, the CLI or any plugin (it reaches plugins only through the
plugin manager); plugins and the ops library never import the server or the CLI; the
ops library never imports a plugin. Checked on every import statement in the source,
function-level ones included, and on what importing the core really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"
FRONT_ENDS = ("pagedllm.server", "pagedllm.cli", "pagedllm.chat_cli", "pagedllm.engine_args", "pagedllm.bench",
              "pagedllm.llm")
FORBIDDEN = {
    "core": FRONT_ENDS + ("pagedllm.plugins", "pagedllm.ops"),
    "ops": FRONT_ENDS + ("pagedllm.plugins",),
    "plugins": FRONT_ENDS,
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, relative ones resolved."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            found.append((node.lineno, base))
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_forbidden_imports(layer):
    broken = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            if module == "pagedllm" or not module.startswith("pagedllm"):
                continue
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN[layer]):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not broken, f"pagedllm/{layer} breaks the dependency rules:\n" + "\n".join(broken)


def test_importing_the_core_loads_no_plugin_server_or_cli_module():
    core = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
                  for p in (PACKAGE / "core").rglob("*.py") if p.stem != "__init__")
    code = (f"import sys\nfor m in {core!r}: __import__(m)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('pagedllm'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    bad = [m for m in loaded if m.startswith(FORBIDDEN["core"])]
    assert not bad, f"importing the core loaded {bad}"
