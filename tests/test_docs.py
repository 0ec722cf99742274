"""The docs stay true to the code: every setting and public name is documented, and every module
path the docs name exists."""

import os
import re

import deferfuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_every_setting_is_documented():
    text = _read("docs", "architecture.md")
    missing = [name for name in deferfuse.config.settings() if f"`{name}`" not in text]
    assert not missing, f"settings missing from docs/architecture.md: {missing}"


def test_every_public_function_is_in_the_readme():
    text = _read("README.md")
    missing = [name for name in deferfuse.__all__ if callable(getattr(deferfuse, name))
               and not isinstance(getattr(deferfuse, name), type) and f"{name}(" not in text]
    assert not missing, f"public functions missing from README.md: {missing}"


# Paths of other projects' files that the docs may name (torch's sources, JAX's): not ours.
_FOREIGN_ROOTS = ("torch", "jax", "jaxlib", "aten", "c10", "third_party")
_ROOT_FOLDERS = ("deferfuse", "bench", "tests", "docs", "corpus", "conformance")
_SUBPACKAGES = sorted(p for p in os.listdir(os.path.join(ROOT, "deferfuse"))
                      if os.path.isdir(os.path.join(ROOT, "deferfuse", p)) and p != "__pycache__")


def _doc_files():
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return [os.path.join("docs", f) for f in docs] + ["README.md"]


def _named_paths(text):
    """Module paths a doc names: ``deferfuse/x/y.py`` anywhere, ``capture/y.py`` (a subpackage of
    deferfuse) anywhere, and any backticked ``x/y.py`` or ``y.py``."""
    subpackages = "|".join(map(re.escape, _SUBPACKAGES))
    found = set(re.findall(r"(?<![\w./-])((?:deferfuse|" + subpackages + r")/[\w./]*?\w\.py)\b", text))
    found |= set(re.findall(r"`([\w./-]+\.py)`", text))
    return {p for p in found if p.split("/")[0] not in _FOREIGN_ROOTS}


def _exists(path):
    """``capture/recorder.py`` is under deferfuse/; ``tests/...``, ``bench/...``, ``docs/...`` and
    ``deferfuse/...`` under the repository; a bare ``name.py`` anywhere in deferfuse/, tests/,
    bench/ or the repository's root."""
    if "/" in path:
        base = ROOT if path.split("/")[0] in _ROOT_FOLDERS else os.path.join(ROOT, "deferfuse")
        return os.path.isfile(os.path.join(base, path))
    if os.path.isfile(os.path.join(ROOT, path)):
        return True
    for folder in ("deferfuse", "tests", "bench", "corpus"):
        for _, _, files in os.walk(os.path.join(ROOT, folder)):
            if path in files:
                return True
    return False


def test_paths_in_the_docs_exist():
    missing = [f"{doc}: {path}" for doc in _doc_files()
               for path in sorted(_named_paths(_read(doc))) if not _exists(path)]
    assert not missing, f"the docs name modules that do not exist: {missing}"
