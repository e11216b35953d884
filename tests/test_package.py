"""The package face: `import ckptstream` (and the reader/writer packages) is cheap — no torch until a name
that needs it is used — and every public name still resolves, also for static tools."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys

import pytest

LAZY_FACES = ["ckptstream", "ckptstream.reader", "ckptstream.writer", "ckptstream.fleet"]


@pytest.mark.parametrize("package", LAZY_FACES)
def test_import_does_not_import_torch(package):
    check = (f"import sys, {package}; assert 'torch' not in sys.modules and 'ray' not in sys.modules, "
             "sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("package", [*LAZY_FACES, "ckptstream.vllm_loader"])
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module), name
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize("package", LAZY_FACES)
def test_static_imports_match_the_lazy_names(package):
    """The TYPE_CHECKING block (what type checkers and IDEs see) names exactly the lazily resolved names,
    from the same modules."""
    module = importlib.import_module(package)
    tree = ast.parse(inspect.getsource(module))
    static: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom)
                static.update({alias.name: "." * statement.level + (statement.module or "")
                               for alias in statement.names})
    assert static == module._LAZY_NAMES
    assert set(module.__all__) - {"__version__"} == set(static)


def test_submodules_still_import_through_the_face():
    from ckptstream import codec, format

    assert codec.__name__ == "ckptstream.codec" and format.__name__ == "ckptstream.format"
    from ckptstream import Stream
    from ckptstream.reader.stream import Stream as DefinedStream

    assert Stream is DefinedStream
