"""The README's Python examples run as written (a block after ``<!-- not run ... -->`` is left out)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = [code for marker, code in re.findall(r"(<!-- not run[^\n]*-->\n)?```python\n(.*?)```", README.read_text(),
                                                re.S) if not marker]


def test_readme_python_example_runs():
    assert EXAMPLES, "README has no Python example"
    namespace = {}
    exec(compile(EXAMPLES[0], str(README), "exec"), namespace)
    assert namespace["dense"].shape == (4, 300, 8, 128)
    assert namespace["out8"].dtype.is_floating_point


@pytest.mark.parametrize("index", range(1, len(EXAMPLES)))
def test_readme_other_python_examples_run(index):
    exec(compile(EXAMPLES[index], str(README), "exec"), {})
