"""Verify sinkax on this machine's GPU in a few minutes (`make gpu-check`); without a GPU, a dry
run on the CPU with tiny sizes, in about a minute (tests/test_gpu_check.py runs it).

Made for a bare GPU machine that reaches no package registry (Python 3.12 with jax and its CUDA
plugin, flax, optax, pytest, matplotlib): the wheels it lacks travel in .whl/ (`make gpu-wheels`
here, then carry .whl there); sinkax itself comes from this checkout (PYTHONPATH), with no build.

Each part runs in a process of its own under its own time limit, and all of them within
--budget seconds; a part over its limit is killed and reported, and a failing part never stops
the next. Parts:

  wheels       install .whl/*.whl into a temporary site (unless grain is importable)
  imports      import grain and sinkax
  env          python, jax, jaxlib, devices, nvidia-smi (driver, CUDA)
  tests        tests/test_sink.py tests/test_model.py tests/test_gpu.py on the GPU
               (SINKAX_TEST_DEVICE=GPU); the dry run runs tests/test_gpu.py alone
  bench-mlp, bench-lenet, bench-transformer
               benchmarks/gpu_sink_sizes.py: steps/s of plain, prefetching, device-only and
               sinkax loops at sink sizes 1, 10, 100, 1000 and one epoch, with the targets
  bench-mlp-while
               bench-mlp under XLA_FLAGS (see FLAG_VARIANTS): every mode's while loops in
               command buffers (CUDA graphs), as sinkax compiles its own on CUDA, so the
               hand-written loops too
  plugin       sinkax's PJRT plugin built here and loaded over jax's CUDA plugin, counting
               host-device interactions (benchmarks/gpu_plugin.py; needs pjrt_c_api.h)
  live-mlp     what stop_if_nonfinite and progress= cost the MLP at sink size 1000, and a
               jax.debug.callback in a hand-written scan (benchmarks/live_costs.py)
  auto-mlp     how closely sink_size="auto" keeps the MLP's calls to 0.1 and 1 s (the default),
               cold, fresh and resumed, and its first 3 calls against fixed sizes'
               (benchmarks/auto_calls.py)
  quiet-mlp    sink-10 calls of a step that does nothing beside an idle and a refilling
               producer, its feeders paused for the calls or not (benchmarks/quiet_feeders.py)
  profile-mlp  where the MLP sinks' host time goes, per thread, beside the rates that bound
               them: with a step that does nothing, over one chunk on the device, with the
               data prepared ahead, the producer parked, a 0.1 ms switch interval; and
               whether a window's launch waits for its chunk's transfer
               (benchmarks/host_profile.py)

Files under $OUT (default ./gpu_check_out): summary.txt, env.txt, tests.log, bench.log,
gpu_sink_sizes.json, gpu_sink_sizes.png (bench.log has live-mlp's and auto-mlp's tables too),
plugin.log, profile.log. The summary table is printed last. The exit status is 0 whatever the
parts did (2 for bad arguments): read the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
SITE = os.path.join(tempfile.gettempdir(), "sinkax-gpu-site")
WORKLOADS = ("mlp", "lenet", "transformer")
# seconds per part on a GPU, then in the dry run, each cut to what is left of --budget (on the
# H100 the parts but bench-transformer took 398 s in all at fa1fb3c, none near its limit, with
# a variant since dropped, ~30 s, and less since added; the transformer ~100 s). The dry run's
# limits only catch a hung part: about a minute in all on 2 quiet cores, it may take several
# times that beside other work (tests/test_gpu_check.py runs it in the test suite)
LIMITS = {
    "wheels": (60, 60),
    "imports": (30, 60),
    "env": (45, 60),
    "tests": (120, 120),
    "bench-mlp": (80, 150),
    "bench-lenet": (100, 150),
    "bench-transformer": (130, 150),
    "bench-mlp-while": (80, 150),
    "plugin": (35, 60),
    "live-mlp": (90, 120),
    "auto-mlp": (150, 120),
    "quiet-mlp": (60, 90),
    "profile-mlp": (90, 90),
}
BUDGET_S = 480  # --budget's default, on a GPU and in the dry run (parts past it: SKIP)
# bench-mlp again under XLA_FLAGS: every mode's while loops recorded into command buffers (CUDA
# graphs with a conditional node), as sinkax compiles its own on CUDA: the hand-written loops
# compiled alike (bench-mlp's "XLA defaults" rows have sinkax compiled as XLA's defaults)
FLAG_VARIANTS = {"while": "--xla_gpu_enable_command_buffer=+WHILE"}

ENV_SCRIPT = """
import json, platform, subprocess, jax, jaxlib
print("python", platform.python_version(), "at", __import__("sys").executable)
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
for d in jax.devices():
    print("device", d.id, d.platform, getattr(d, "device_kind", ""), d.memory_stats() and "memory")
try:
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    print("\\n".join(line for line in smi.splitlines()[:12] if line.strip()))
except (OSError, subprocess.TimeoutExpired) as error:
    print("nvidia-smi:", error)
gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm")]
print("GPUS", json.dumps([getattr(d, "device_kind", str(d)) for d in gpus]))
"""


@dataclasses.dataclass
class Outcome:
    part: str
    status: str  # PASS, FAIL, TIMEOUT, SKIP
    seconds: float
    note: str = ""


class Budget:
    """The time left of the whole check; each part gets its limit or what is left."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def limit(self, part_limit: float) -> float:
        return max(0.0, min(part_limit, self.end - time.monotonic()))


def run_part(part, argv, log_path, limit, env) -> tuple[Outcome, str]:
    """Run ``argv`` with its output appended to ``log_path``, killed (with its children) after
    ``limit`` seconds. Returns the outcome and what the run wrote."""
    if limit < 5:
        return Outcome(part, "SKIP", 0.0, "no time left in --budget"), ""
    with open(log_path, "a") as log:
        start = log.seek(0, os.SEEK_END)
        log.write(f"\n=== {part}: {' '.join(argv)} (limit {limit:.0f} s)\n")
        log.flush()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            return Outcome(part, "FAIL", 0.0, f"could not start: {error}"), ""
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        seconds = time.monotonic() - t0
    with open(log_path) as log:
        log.seek(start)
        text = log.read()
    if code is None:
        return Outcome(part, "TIMEOUT", seconds, f"killed after {limit:.0f} s"), text
    return Outcome(part, "PASS" if code == 0 else "FAIL", seconds, f"exit {code}"), text


def parse_env(text: str) -> list[str]:
    """The GPUs the env part's script listed (none if it failed)."""
    for line in text.splitlines():
        if line.startswith("GPUS "):
            return json.loads(line[5:])
    return []


def pytest_note(text: str) -> str:
    """pytest's summary line, then its first failures."""
    lines = text.splitlines()
    summary = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed|skipped)", ln)]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return "; ".join(summary[-1:] + failures[:5]) or "no pytest summary"


def bench_note(path: str) -> str:
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError):
        return "no results written"
    if results["dry_run"]:
        return "ran (dry run: tiny sizes, no targets)"
    met = [ratio >= threshold for _, ratio, threshold in results["targets"]]
    rows = {row["mode"]: row for row in results["rows"]}
    sink10, bound = rows.get("sinkax 10", {}), rows.get("device scan", {})
    loud = rows.get("not quiet 10")  # the feeders not paused for the calls (channel.quiet)
    loud_note = f" (not quiet {loud['x hand best']:.2f}x)" if loud else ""
    return (
        f"targets met: {sum(met)}/{len(met)}; sinkax 10 {sink10.get('x hand best', 0):.2f}x "
        f"hand best{loud_note}; device scan {bound.get('steps/s', 0):.0f} steps/s"
    )


def report(parts: dict[str, str], out_json: str, out_png: str, dry_run: bool) -> None:
    """Merge the workloads' JSON files into one and draw steps/s relative to plain."""
    results = {}
    for name, path in parts.items():
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
    with open(out_json, "w") as f:
        json.dump({"dry_run": dry_run, "workloads": results}, f, indent=2)
    if not results:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, payload) in zip(axes[0], results.items(), strict=True):
        rows = payload["rows"]
        modes = [r["mode"] for r in rows]
        colors = ["tab:blue" if m.startswith("sinkax") else "tab:gray" for m in modes]
        ax.barh(modes, [r["x plain"] for r in rows], color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("steps/s relative to the plain jitted loop")
        ax.set_title(name)
    machine = next(iter(results.values()))["machine"]
    kind = "DRY RUN (tiny sizes) on " if dry_run else ""
    fig.suptitle(f"sinkax sink sizes -- {kind}{machine['device']}, jax {machine['jax']}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)


class Check:
    """The parts of one check: where they write, their environment, the time left."""

    def __init__(self, out: str, budget: float, dry_run: bool, skip: list[str]):
        self.out, self.skip, self.outcomes = out, skip, []
        self.budget = Budget(budget)
        self.use(dry_run)

    def use(self, dry_run: bool) -> None:
        """Run the parts from now on on the GPU, or dry (CPU, tiny sizes)."""
        self.dry_run = dry_run
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        path = [ROOT, SITE, *filter(None, [os.environ.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(path)
        if dry_run:
            env["JAX_PLATFORMS"] = "cpu"
        self.env = env

    def run(self, part: str, argv: list[str], log: str, note=None, **env: str) -> str:
        """Run one part (unless skipped) within its limit, its outcome's note ``note(output)``
        if given; returns its output."""
        if part in self.skip:
            return ""
        limit = self.budget.limit(LIMITS[part][1 if self.dry_run else 0])
        outcome, text = run_part(
            part, argv, os.path.join(self.out, log), limit, {**self.env, **env}
        )
        if note is not None and outcome.status in ("PASS", "FAIL"):
            outcome.note = note(text)
        self.outcomes.append(outcome)
        return text

    def setup(self) -> None:
        """Install the carried wheels, unless grain is here already (then they may well be for
        another Python); import grain and sinkax."""
        wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
        if importlib.util.find_spec("grain"):
            wheels = []
        shutil.rmtree(SITE, ignore_errors=True)
        if wheels:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            self.run("wheels", [*pip, "--no-compile", "--target", SITE, *wheels], "env.txt")
        check = "import grain, sinkax; print('grain', grain.__version__, 'sinkax', sinkax.__file__)"
        last_line = lambda text: f"{len(wheels)} wheel(s); " + " ".join(text.splitlines()[-1:])  # noqa: E731
        self.run("imports", [sys.executable, "-c", check], "env.txt", last_line)

    def environment(self) -> list[str]:
        """Print the environment into env.txt; returns the GPUs jax sees."""
        gpus = lambda text: ", ".join(parse_env(text)) or "no GPU seen by jax"  # noqa: E731
        return parse_env(self.run("env", [sys.executable, "-c", ENV_SCRIPT], "env.txt", gpus))

    def tests(self) -> None:
        files = ["tests/test_gpu.py"]
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=120"]
        if not self.dry_run:
            files[:0] = ["tests/test_sink.py", "tests/test_model.py"]
            if importlib.util.find_spec("xdist"):  # 16 cores there: compile 4 tests at a time
                argv += ["-n", "4"]
        device = "CPU" if self.dry_run else "GPU"
        argv += files
        self.run("tests", argv, "tests.log", pytest_note, SINKAX_TEST_DEVICE=device)

    def benchmarks(self) -> None:
        """Each workload in a process of its own; then their JSON merged, and a plot."""
        parts = {}
        runs = [(name, name, {}) for name in WORKLOADS]
        given = self.env.get("XLA_FLAGS", "")
        for variant, flags in FLAG_VARIANTS.items():
            runs.append((f"mlp-{variant}", "mlp", {"XLA_FLAGS": f"{given} {flags}".strip()}))
        with tempfile.TemporaryDirectory() as folder:
            for name, workload, env in runs:
                parts[name] = os.path.join(folder, f"{name}.json")
                argv = [sys.executable, os.path.join(BENCH, "gpu_sink_sizes.py"), workload]
                argv += ["--out", parts[name]] + ["--dry-run"] * self.dry_run
                note = lambda _, n=name: bench_note(parts[n])  # noqa: E731
                self.run(f"bench-{name}", argv, "bench.log", note, **env)
            stem = os.path.join(self.out, "gpu_sink_sizes")
            try:
                report(parts, f"{stem}.json", f"{stem}.png", self.dry_run)
            except Exception as error:  # a report that fails must not hide the summary
                print(f"could not write the benchmark report: {error!r}")

    def plugin(self) -> None:
        argv = [sys.executable, os.path.join(BENCH, "gpu_plugin.py")] + ["--dry-run"] * self.dry_run
        last_line = lambda text: " ".join(text.strip().splitlines()[-1:])[:100]  # noqa: E731
        self.run("plugin", argv, "plugin.log", last_line)

    def tables(self, part: str, script: str, args: list[str], note) -> None:
        """``script`` with ``args``, its tables into bench.log (its JSON is not kept: at most 8
        files come back from a device machine)."""
        with tempfile.TemporaryDirectory() as folder:
            argv = [sys.executable, os.path.join(BENCH, script), "--out-dir", folder, *args]
            self.run(part, argv, "bench.log", note)

    def live(self) -> None:
        """The live-sink costs."""
        smoke = ["--steps", "200", "--repeats", "1", "--sink-size", "100"]
        verdicts = lambda text: "; ".join(re.findall(r"(?:PASS|MISS|----) .*?: [\d.]+x", text))  # noqa: E731
        gpu = ["--device", "gpu", "--repeats", "7"]
        self.tables("live-mlp", "live_costs.py", smoke if self.dry_run else gpu, verdicts)

    def auto(self) -> None:
        """The auto sinks' call times."""
        smoke = ["--workloads", "mlp", "--targets", "0.05", "--calls", "5"]
        verdicts = lambda text: "; ".join(re.findall(r"at [\d.]+ s, \w+: \d+/\d+", text))  # noqa: E731
        gpu = ["--workloads", "mlp", "--device", "gpu", "--targets", "0.1", "1.0"]
        self.tables("auto-mlp", "auto_calls.py", smoke if self.dry_run else gpu, verdicts)

    def quiet(self) -> None:
        """Sink calls beside a refilling producer, with quiet feeders and without."""
        smoke = ["--calls", "20", "--steady-steps", "400", "--repeats", "1"]
        gpu = ["--device", "gpu", "--repeats", "5"]
        verdict = lambda text: " ".join(re.findall(r"refilling: .*", text))  # noqa: E731
        self.tables("quiet-mlp", "quiet_feeders.py", smoke if self.dry_run else gpu, verdict)

    def profile(self) -> None:
        sizes = ["10"] if self.dry_run else ["10", "100", "1000"]
        steps = "200" if self.dry_run else "20000"
        argv = [sys.executable, os.path.join(BENCH, "host_profile.py"), "mlp", "--sizes", *sizes]
        rates = lambda text: "; ".join(re.findall(r"sink \d+: \d+ steps/s", text))  # noqa: E731
        self.run("profile-mlp", [*argv, "--steps", steps], "profile.log", rates)


def summarize(outcomes: list[Outcome], dry_run: bool, seconds: float) -> str:
    """The summary table: one line per part, the GPU or dry run named first."""
    passed = sum(o.status == "PASS" for o in outcomes)
    kind = "DRY RUN on the CPU (tiny sizes, not GPU figures)" if dry_run else "on the GPU"
    lines = [f"sinkax gpu-check {kind}: {passed}/{len(outcomes)} parts passed in {seconds:.0f} s"]
    width = max(len(o.part) for o in outcomes)
    for o in outcomes:
        lines.append(f"  {o.part.ljust(width)}  {o.status:<7}  {o.seconds:6.1f} s  {o.note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny sizes (the default without a GPU)"
    )
    parser.add_argument("--budget", type=float, help=f"seconds for everything (default {BUDGET_S})")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu_check_out",
        help="the results folder (default $OUT)",
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=list(LIMITS), help="parts not to run"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    for name in ("env.txt", "tests.log", "bench.log", "plugin.log", "profile.log"):
        open(os.path.join(args.out, name), "w").close()
    check = Check(args.out, args.budget or BUDGET_S, args.dry_run, args.skip)
    check.setup()
    if not check.environment() and not check.dry_run:
        print("No GPU seen by jax (env.txt says why): a dry run on the CPU with tiny sizes.")
        check.use(dry_run=True)
    check.tests()
    check.benchmarks()
    check.plugin()
    check.live()
    check.auto()
    check.quiet()
    check.profile()
    summary = summarize(check.outcomes, check.dry_run, time.monotonic() - started)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
