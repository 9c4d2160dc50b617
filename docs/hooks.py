"""mkdocs hook: render the doctest examples of sinkax's docstrings as code blocks.

The docstrings hold bare ``>>>`` examples (pytest runs them). Markdown would read their output
lines as text, e.g. ``[(1024, 128), (128, 10)]`` as a reference link, so each run of doctest
lines (from a ``>>>`` line to the next blank line) is fenced as ``pycon`` before rendering.
"""

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

PROMPT = re.compile(r"^(\s*)>>> ")


class DoctestFence(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        indent = None
        in_fence = False
        for line in lines:
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if indent is None and not in_fence and (match := PROMPT.match(line)):
                indent = match.group(1)
                out.append(f"{indent}```pycon")
            elif indent is not None and not line.strip():
                out.append(f"{indent}```")
                indent = None
            out.append(line)
        if indent is not None:
            out.append(f"{indent}```")
        return out


class DoctestExtension(Extension):
    def extendMarkdown(self, md):
        md.preprocessors.register(DoctestFence(md), "doctest_fence", 30)


@event_priority(100)  # before mkdocstrings reads the extensions
def on_config(config):
    config.markdown_extensions.append(DoctestExtension())
    return config
