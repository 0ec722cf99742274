"""The docs stay true to the code: every setting and public name is documented."""

import os

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
