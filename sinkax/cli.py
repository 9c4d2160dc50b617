"""``sinkax train``: MindSpore's LeNet5/MNIST reference training, sunk to the device.

Trains :func:`sinkax.nets.lenet5_apply` on MNIST (the bundled 5,000-image sample, or the full
IDX set with ``--data-dir``) with ``Model.train``, printing ``LossMonitor`` and ``TimeMonitor``
lines, then the accuracy on the held-out test images and a one-line summary.

    sinkax train                      # 15 epochs, one sink (125 steps) per epoch
    sinkax train --sink-size 50 --epochs 30
    sinkax train --sink-size auto --call-seconds 0.5   # each epoch in calls of about 0.5 s
    sinkax train --no-sink            # one host batch per step, for comparison
    sinkax train --lr 0.01 --schedule constant --epochs 20   # MindSpore's exact nn.Momentum
    python -m sinkax train --data-dir ~/MNIST --epochs 2
    sinkax train --devices 4          # data parallel over 4 forced host CPU devices
    python -m sinkax.launch -n 2 -- sinkax train --devices 2   # 2 processes x 2 devices

The default optimizer is SGD with momentum 0.9 (``nn.Momentum``) at a peak learning rate of 0.03
decayed to 0 by a cosine schedule: LeNet5's TruncatedNormal(0.02) initialisation leaves the loss
flat at log(10) for several epochs, and the reference's constant 0.01 gets off that plateau late
(epoch 6 to 9) and then swings by a few points of accuracy from epoch to epoch.
``--checkpoint-dir DIR`` saves every epoch and resumes from the latest checkpoint in ``DIR``;
``--progress K`` shows a progress bar advanced every K steps from inside each sink.
``--sink-size auto`` runs each epoch as sinks sized to last about ``--call-seconds`` each
(``Model.train(..., sink_size="auto")``), so a loss line comes about that often.

>>> build_parser().parse_args(["train", "--epochs", "2"]).epochs
2
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence


def _at_least(least: int, most: int = sys.maxsize) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be from {least} to {most}, got {value}")
        return value

    parse.__name__ = "int"  # what argparse calls a value it cannot read: "invalid int value"
    return parse


_positive, _natural = _at_least(1), _at_least(0)


def _sink_size(text: str) -> int | str:
    """``--sink-size``: ``auto``, ``-1`` or a positive int (its upper bound checked by
    ``Model.train``)."""
    if text == "auto":
        return text
    if not ((text.isdigit() and int(text) > 0) or text == "-1"):
        raise argparse.ArgumentTypeError(f"must be a positive int, -1 or auto, got {text!r}")
    return int(text)


def _float(ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """Parses a float for which ``ok`` holds (NaN never does)."""

    def parse(text: str) -> float:
        value = float(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


_seconds = _float(lambda value: 0 < value < math.inf, "seconds > 0")
_rate = _float(lambda value: 0 < value < math.inf, "a learning rate > 0")
_momentum = _float(lambda value: 0 <= value < 1, "a momentum in [0, 1)")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is ``None``: the help of such an option says what
    happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``sinkax`` argument parser."""
    parser = argparse.ArgumentParser(prog="sinkax", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train LeNet5 on MNIST (MindSpore's reference example)",
        description="Train LeNet5 on MNIST with sinkax.Model (MindSpore's reference example).",
        formatter_class=_Defaults,
    )
    train.add_argument("--epochs", type=_positive, default=15, help="epochs to train")
    train.add_argument("--batch-size", type=_positive, default=32, help="training batch size")
    train.add_argument(
        "--sink-size",
        type=_sink_size,
        default=-1,
        help="steps per sink (= per epoch); -1: whole pass; auto: each pass in sinks of about "
        "--call-seconds",
    )
    train.add_argument(
        "--call-seconds",
        type=_seconds,
        default=None,
        metavar="S",
        help="with --sink-size auto: the seconds one sink should last (default 1)",
    )
    train.add_argument(
        "--no-sink", action="store_true", help="dataset_sink_mode=False: one host step per batch"
    )
    train.add_argument(
        "--device",
        default=None,
        help="device target: CPU, GPU, Ascend or Emulated (default: Emulated where the "
        "environment variable SINKAX_PJRT selects the emulated device, else CPU)",
    )
    train.add_argument("--device-id", type=int, default=0, help="device number")
    train.add_argument(
        "--devices",
        type=_positive,
        default=None,
        help="data parallel: split each batch over this many forced host CPU devices (per "
        "process under python -m sinkax.launch, which also splits over the processes)",
    )
    train.add_argument("--seed", type=_natural, default=0, help="initialisation and shuffling seed")
    train.add_argument("--lr", type=_rate, default=0.03, help="(peak) learning rate")
    train.add_argument("--momentum", type=_momentum, default=0.9, help="SGD momentum")
    train.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="learning-rate schedule: cosine decay to 0 over the run, or constant (MindSpore's "
        "reference is constant with --lr 0.01)",
    )
    train.add_argument(
        "--data-dir", default=None, help="folder with the MNIST IDX files (default: bundled sample)"
    )
    train.add_argument(
        "--checkpoint-dir", default=None, help="save every epoch here; resume from it if present"
    )
    train.add_argument(
        "--progress",
        type=_positive,
        default=None,
        metavar="K",
        help="a progress bar (tqdm, on stderr) advanced every K steps from inside each sink",
    )
    return parser


def _eval_batch_size(num_images: int, limit: int = 500, multiple_of: int = 1) -> int:
    """The largest batch size up to ``limit`` that divides ``num_images`` (no image left out)
    and splits evenly over ``multiple_of`` devices (else the largest multiple of it: the
    remainder is left out).

    >>> _eval_batch_size(1000), _eval_batch_size(1000, multiple_of=3)
    (500, 498)
    """
    sizes = range(multiple_of, min(limit, num_images) + 1, multiple_of)
    whole = [size for size in sizes if num_images % size == 0]
    return max(whole or sizes)


def train_lenet(args: argparse.Namespace) -> float:
    """Run ``sinkax train``; returns the test accuracy."""
    if args.no_sink and (args.sink_size != -1 or args.call_seconds is not None):
        raise ValueError("--no-sink runs a step per batch, no sinks to size: drop --sink-size "
                         "and --call-seconds, or --no-sink.")  # fmt: skip
    if args.call_seconds is not None and args.sink_size != "auto":
        raise ValueError("--call-seconds sizes the sinks of --sink-size auto: give both.")
    import jax
    import optax

    import sinkax
    from sinkax import datasets, nets
    from sinkax.train import (
        LossMonitor,
        Model,
        ModelCheckpoint,
        ProgressBar,
        TimeMonitor,
        cross_entropy,
    )

    start = time.perf_counter()
    launched = "SINKAX_PROCESS_ID" in os.environ  # by python -m sinkax.launch
    if args.device is None:
        args.device = "Emulated" if sinkax.pjrt.env_preset() else "CPU"
    if args.devices is not None:
        if args.device != "CPU":
            raise ValueError("--devices forces host CPU devices: use it with --device CPU.")
        jax.config.update("jax_num_cpu_devices", args.devices)  # before jax starts its backend
    if launched:
        sinkax.distributed.initialize()
    sinkax.set_context(mode=sinkax.GRAPH_MODE, device_target=args.device, device_id=args.device_id)
    parallel = args.devices is not None or launched
    if parallel and args.batch_size % jax.device_count():
        raise ValueError(
            f"--batch-size {args.batch_size} does not split over {jax.device_count()} devices: "
            "give a multiple of the number of devices."
        )
    train_set = datasets.lenet_mnist(args.batch_size, "train", args.seed, args.data_dir)
    num_test = len(datasets.mnist("test", args.data_dir))
    eval_batch = _eval_batch_size(num_test, multiple_of=jax.device_count() if parallel else 1)
    test_set = datasets.lenet_mnist(eval_batch, "test", data_dir=args.data_dir)
    sink_options = {}
    if parallel:  # every process feeds its block of each global batch
        sink_options["sharding"] = sinkax.distributed.batch_sharding()
        train_set = train_set.map(sinkax.distributed.local_rows)
        test_set = test_set.map(sinkax.distributed.local_rows)
    where = (
        f"{jax.device_count()} devices in {jax.process_count()} process(es), batch split"
        if parallel
        else f"{sinkax.backend.default_device()!r}"  # EmuDevice(id=0), CudaDevice(id=0), ...
    )
    source = args.data_dir or "the bundled 5,000-image sample"
    fixed = args.sink_size != "auto" and args.sink_size > 0 and not args.no_sink
    steps = args.sink_size if fixed else len(train_set)
    sinks = f"sink_size={args.sink_size}"
    if args.sink_size == "auto":
        sinks += f" (calls of about {args.call_seconds or 1.0:g} s)"
    print(
        f"LeNet5 on MNIST from {source}: {len(train_set) * args.batch_size} training images in "
        f"batches of {args.batch_size}, {num_test} test images; {args.epochs} epochs of {steps} "
        f"steps, {'no sink' if args.no_sink else sinks}, on {where}",
        flush=True,
    )
    lr = args.lr
    if args.schedule == "cosine":
        lr = optax.cosine_decay_schedule(args.lr, args.epochs * steps)
    model = Model(
        nets.lenet5_apply,
        nets.lenet5_init(jax.random.key(args.seed)),
        cross_entropy,
        optax.sgd(lr, momentum=args.momentum),
        sink_options=sink_options,
    )
    callbacks = [LossMonitor(), TimeMonitor()]
    if args.progress:
        callbacks.append(ProgressBar(every=args.progress))
    resume = None
    if args.checkpoint_dir:
        checkpoint = ModelCheckpoint(args.checkpoint_dir, keep_last=3)
        callbacks.append(checkpoint)
        resume = checkpoint if checkpoint.latest_step() is not None else None
    run = model.train(
        args.epochs,
        train_set,
        callbacks=callbacks,
        dataset_sink_mode=not args.no_sink,
        sink_size=-1 if args.no_sink else args.sink_size,
        resume_from=resume,
        call_seconds=None if args.no_sink else args.call_seconds,
    )
    accuracy = model.eval(test_set)["accuracy"]
    strategy = run.sink_stats.strategy if run.sink_stats else "none (no sink)"
    print(f"test accuracy: {accuracy:.4f} on {num_test} images", flush=True)
    print(
        f"sinkax train: accuracy {accuracy:.4f}, wall time {time.perf_counter() - start:.1f} s, "
        f"sink strategy {strategy}, {run.step} steps",
        flush=True,
    )
    return accuracy


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sinkax`` console script and ``python -m sinkax``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        train_lenet(args)
    except (ValueError, FileNotFoundError) as error:  # bad options, missing data: no traceback
        parser.exit(2, f"sinkax {args.command}: error: {error}\n")
    return 0
