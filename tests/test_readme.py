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


def test_module_table_lists_every_kernel_module_in_its_folder():
    """Kernel modules live in ``jagged_attn/kernels/``'s subpackages; the README's module table has a row per
    subpackage naming each of its modules, and no row for a folder that is not there."""
    kernels = README.parent / "jagged_attn" / "kernels"
    assert [p.name for p in kernels.glob("*.py")] == ["__init__.py"]  # every kernel module in a subpackage
    rows = dict(re.findall(r"^\| `(jagged_attn/kernels/\w+/)` \| (.*) \|$", README.read_text(), re.M))
    folders = {f"jagged_attn/kernels/{p.name}/" for p in kernels.iterdir() if (p / "__init__.py").is_file()}
    assert set(rows) == folders
    for folder in folders:
        modules = {p.name for p in (README.parent / folder).glob("*.py")} - {"__init__.py"}
        assert modules == set(re.findall(r"`(\w+\.py)`", rows[folder])), folder
