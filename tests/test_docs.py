"""The README's code runs as written; the public API is curated and documented."""

import re
from pathlib import Path

import engine as eg

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    namespace = {"__name__": "__readme__"}  # blocks build on each other, as a reader's session
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_every_public_name_is_exported_and_documented():
    from engine import optim

    for module in (eg, optim):
        assert len(module.__all__) == len(set(module.__all__))
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) or isinstance(obj, type):
                assert obj.__doc__ and obj.__doc__.strip(), (
                    f"{module.__name__}.{name} has no docstring"
                )
