"""Every python block in the README and in docs/ runs as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def test_readme_has_examples():
    assert any(page == "README.md" for page, _, _ in BLOCKS)


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{page}:{i}" for page, i, _ in BLOCKS])
def test_example_runs(page, index, block):
    exec(compile(block, f"{page} block {index}", "exec"), {})
