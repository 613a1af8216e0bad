"""The one-way arrows between Kiln's packages (STYLE.md, DESIGN.md section 4), read from the source:
an import that points back up fails here, naming the file and the import, before it becomes a circle."""

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"


def imports_of(path: Path) -> set[str]:
    """Every kiln module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("kiln")}


def offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(KILN.parent)} imports {name}"
            for path in sorted((KILN / folder).rglob("*.py"))
            for name in sorted(imports_of(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_where_compiled_code_comes_from_never_imports_what_gets_compiled():
    # kiln/compile/artifacts (cache, precompiled, background) sits below regions and the session.
    above = ("kiln.compile.regions", "kiln.compile.groups", "kiln.compile.monitor", "kiln.compile.report",
             "kiln.compile.session", "kiln.accelerator", "kiln.parallel")
    assert offending("compile/artifacts", above) == []


def test_the_compile_package_never_imports_the_facade_or_a_strategy():
    assert offending("compile", ("kiln.accelerator", "kiln.parallel", "kiln.checkpoint")) == []


def test_checkpoint_folder_readers_do_not_import_each_other():
    # kiln.checkpoint.api chooses between Kiln's folders and Accelerate's; neither reader knows the other.
    state = imports_of(KILN / "checkpoint/training_state.py")
    assert "kiln.checkpoint.accelerate_folder" not in state
    assert not any(name.startswith("kiln.checkpoint.api") for name in state | imports_of(KILN / "checkpoint/accelerate_folder.py"))
