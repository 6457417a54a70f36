"""The public API a user can rely on: every name the README and the docs import in their examples is importable
from where they say, and a name that moved keeps working for a release with a ``DeprecationWarning``.

The documented names are read from the Python code blocks of README.md and docs/*.md (their ``from kvtc... import``
lines), so a rename that forgets the docs fails here."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def documented_imports() -> list[tuple[str, str, str]]:
    """``(document, module, name)`` for every ``from kvtc... import name`` in a Python code block of the docs."""
    found = []
    for doc in DOCS:
        for block in BLOCK.findall(doc.read_text()):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvtc":
                    found += [(doc.name, node.module, alias.name) for alias in node.names]
    return found


IMPORTS = documented_imports()


def test_the_docs_document_imports():
    """The parser finds the README's examples (a test that reads nothing would pass for any API)."""
    modules = {m for _, m, _ in IMPORTS}
    assert {"kvtc", "kvtc.codec", "kvtc.store", "kvtc.integrations.hf"} <= modules, sorted(modules)


@pytest.mark.parametrize(("doc", "module", "name"), IMPORTS, ids=[f"{d}:{m}.{n}" for d, m, n in IMPORTS])
def test_every_documented_name_imports_without_warning(doc, module, name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        mod = importlib.import_module(module)
        assert getattr(mod, name) is not None, f"{doc} imports {name} from {module}"
    ours = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and "kvtc" in str(w.message)]
    assert not ours, f"{doc} imports {name} from {module}, which is deprecated: {ours}"  # docs name the current place


#: names that moved: (old module, name, new module); each keeps an alias that warns for one release
MOVED = [
    ("kvtc.integrations.hf_calibrate", "check_model", "kvtc.integrations.hf"),
    ("kvtc.calibration", "load_calibration", "kvtc.integrations.hf_calibrate"),
    ("kvtc.calibration.load", "load_calibration", "kvtc.integrations.hf_calibrate"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_a_moved_name_still_imports_with_a_deprecation_warning(old, name, new):
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(new), name)
