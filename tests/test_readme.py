"""The README's Python example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs():
    examples = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert examples, "README has no Python example"
    namespace = {}
    exec(compile(examples[0], str(README), "exec"), namespace)
    assert namespace["dense"].shape == (4, 300, 8, 128)
    assert namespace["out8"].dtype.is_floating_point
