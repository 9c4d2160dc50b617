"""The README's examples run as printed, and do what the README says they do."""

import ast
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(marker: str) -> str:
    """The ```python block that follows the README's ``<!-- tested by ...: marker -->`` line."""
    pattern = rf"<!-- tested by tests/test_readme.py: {re.escape(marker)} -->\n```python\n(.*?)```"
    blocks = re.findall(pattern, README.read_text(), re.DOTALL)
    assert len(blocks) == 1, f"README needs exactly one block marked {marker!r}"
    return blocks[0]


def run_printing(code: str) -> list[str]:
    """Runs ``code`` and returns what it printed, one string per print call."""
    printed: list[str] = []
    exec(code, {"print": lambda *args: printed.append(" ".join(map(str, args)))})
    return printed


def test_ten_line_example_loss_falls_every_epoch():
    code = readme_block("the mean loss falls every epoch")
    assert len(code.strip().splitlines()) <= 11  # "In ten lines" (+ the blank after imports)
    printed = run_printing(code)
    losses = [float(re.fullmatch(r"epoch \d+: mean loss ([\d.]+)", line)[1]) for line in printed]
    assert len(losses) == 3
    assert losses[0] > losses[1] > losses[2]
    assert losses[2] < losses[0] / 2, losses


def test_flax_example_learns():
    pytest.importorskip("flax")
    printed = run_printing(readme_block("the model learns"))
    result = ast.literal_eval(printed[-1])
    assert set(result) == {"loss", "accuracy"}
    assert result["accuracy"] > 0.5, result  # ten classes: chance is 0.1


def test_docs_home_shows_the_tested_example():
    home = (README.parent / "docs" / "index.md").read_text()
    assert f"```python\n{readme_block('the mean loss falls every epoch')}```" in home


def code_lines(markdown: str) -> list[str]:
    """The lines inside the fenced code blocks of ``markdown``."""
    return [
        line
        for block in re.findall(r"```\w*\n(.*?)```", markdown, re.DOTALL)
        for line in block.splitlines()
    ]


def test_the_docs_home_code_fits_the_text_column():
    # about 85 columns of code fit the docs' text column at 1280 px; with a margin, no
    # end-of-line comment (the install extras, the first example's) hides behind a scroll bar
    text = (README.parent / "docs" / "index.md").read_text()
    wide = [line for line in code_lines(text) if len(line) > 80]
    assert wide == [], wide
