"""``python -m sinkax.launch -n N -- COMMAND ...``: N processes of a ``jax.distributed`` job on
this machine.

Each process runs ``COMMAND`` with ``JAX_COORDINATOR_ADDRESS`` (process 0 serves it on a free
local port), ``SINKAX_NUM_PROCESSES`` and ``SINKAX_PROCESS_ID`` set; the program calls
:func:`sinkax.distributed.initialize` (``sinkax train`` does), which passes them to
``jax.distributed.initialize``. ``--devices D`` gives each process ``D`` forced host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=D``), to try data parallelism on a laptop.

The launcher returns the first non-zero exit code of its processes. When one fails, the others
get ``--grace`` seconds to end by themselves (a sink stops every process with
:class:`~sinkax.distributed.PeerError`) and are then killed, as they are on Ctrl-C: no process
outlives the launcher.

    python -m sinkax.launch -n 2 --devices 2 -- sinkax train --epochs 2
    python -m sinkax.launch -n 2 -- python my_training.py

On a cluster, start one process per host with the scheduler instead (SLURM's ``srun``,
``torchrun``, a Kubernetes indexed Job): :func:`sinkax.distributed.initialize` joins the job
from the variables each sets (:func:`sinkax.distributed.cluster_arguments`).

>>> command(build_parser().parse_args(["-n", "2", "--", "python", "x.py"]))
['python', 'x.py']
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The ``sinkax.launch`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m sinkax.launch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("-n", "--processes", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--devices", type=int, default=None, help="forced host CPU devices per process"
    )
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds the others get after a failure"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    return parser


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environments(processes: int, devices: int | None, port: int) -> list[dict[str, str]]:
    """The environment of each process (see the module docstring).

    >>> [e["SINKAX_PROCESS_ID"] for e in environments(2, None, 1234)]
    ['0', '1']
    """
    base = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
    base["SINKAX_NUM_PROCESSES"] = str(processes)
    if devices is not None:
        flags = base.get("XLA_FLAGS", "")
        base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return [dict(base, SINKAX_PROCESS_ID=str(i)) for i in range(processes)]


def run(
    command: Sequence[str], processes: int, devices: int | None = None, grace: float = 30.0
) -> int:
    """Run ``command`` as ``processes`` processes of one job; their first non-zero exit code."""
    if processes < 1 or not command:
        raise ValueError("give -n N (N >= 1) and a command after --")
    children = [
        subprocess.Popen(list(command), env=env, start_new_session=True)
        for env in environments(processes, devices, free_port())
    ]
    try:
        return _wait(children, grace)
    finally:
        for child in children:  # Ctrl-C, a failure past the grace period, or any error here
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def _wait(children: list[subprocess.Popen], grace: float) -> int:
    deadline = None
    while True:
        codes = [child.poll() for child in children]
        failed = [code for code in codes if code]
        if None not in codes:
            return failed[0] if failed else 0
        if failed:
            deadline = deadline or time.monotonic() + grace
            if time.monotonic() > deadline:
                return failed[0]
        time.sleep(0.05)


def command(args: argparse.Namespace) -> list[str]:
    """The command to run, from parsed arguments (without the ``--`` that separates it)."""
    return args.command[1:] if args.command[:1] == ["--"] else args.command


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m sinkax.launch -n N [--devices D] -- COMMAND ...``."""
    args = build_parser().parse_args(argv)
    return run(command(args), args.processes, args.devices, args.grace)


if __name__ == "__main__":
    sys.exit(main())
