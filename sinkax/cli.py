"""``sinkax train``: MindSpore's LeNet5/MNIST reference training, sunk to the device.

Trains :func:`sinkax.nets.lenet5_apply` on MNIST (the bundled 5,000-image sample, or the full
IDX set with ``--data-dir``) with ``Model.train``, printing ``LossMonitor`` and ``TimeMonitor``
lines, then the accuracy on the held-out test images and a one-line summary.

    sinkax train                      # 15 epochs, one sink (125 steps) per epoch
    sinkax train --sink-size 50 --epochs 30
    sinkax train --no-sink            # one host batch per step, for comparison
    sinkax train --lr 0.01 --schedule constant --epochs 20   # MindSpore's exact nn.Momentum
    python -m sinkax train --data-dir ~/MNIST --epochs 2

The default optimizer is SGD with momentum 0.9 (``nn.Momentum``) at a peak learning rate of 0.03
decayed to 0 by a cosine schedule: LeNet5's TruncatedNormal(0.02) initialisation leaves the loss
flat at log(10) for several epochs, and the reference's constant 0.01 gets off that plateau late
(epoch 6 to 9) and then swings by a few points of accuracy from epoch to epoch.
``--checkpoint-dir DIR`` saves every epoch and resumes from the latest checkpoint in ``DIR``.

>>> build_parser().parse_args(["train", "--epochs", "2"]).epochs
2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``sinkax`` argument parser."""
    parser = argparse.ArgumentParser(prog="sinkax", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train LeNet5 on MNIST (MindSpore's reference example)",
        description="Train LeNet5 on MNIST with sinkax.Model (MindSpore's reference example).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--epochs", type=_positive, default=15, help="epochs to train")
    train.add_argument("--batch-size", type=int, default=32, help="training batch size")
    train.add_argument(
        "--sink-size", type=int, default=-1, help="steps per sink (= per epoch); -1: whole pass"
    )
    train.add_argument(
        "--no-sink", action="store_true", help="dataset_sink_mode=False: one host step per batch"
    )
    train.add_argument("--device", default="CPU", help="device target: CPU, GPU or Ascend")
    train.add_argument("--device-id", type=int, default=0, help="device number")
    train.add_argument("--seed", type=int, default=0, help="initialisation and shuffling seed")
    train.add_argument("--lr", type=float, default=0.03, help="(peak) learning rate")
    train.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
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
    return parser


def _eval_batch_size(num_images: int, limit: int = 500) -> int:
    """The largest batch size up to ``limit`` that divides ``num_images``: no image left out."""
    return max(size for size in range(1, min(limit, num_images) + 1) if num_images % size == 0)


def train_lenet(args: argparse.Namespace) -> float:
    """Run ``sinkax train``; returns the test accuracy."""
    import jax
    import optax

    import sinkax
    from sinkax import datasets, nets
    from sinkax.train import LossMonitor, Model, ModelCheckpoint, TimeMonitor, cross_entropy

    start = time.perf_counter()
    sinkax.set_context(mode=sinkax.GRAPH_MODE, device_target=args.device, device_id=args.device_id)
    train_set = datasets.lenet_mnist(args.batch_size, "train", args.seed, args.data_dir)
    num_test = len(datasets.mnist("test", args.data_dir))
    test_set = datasets.lenet_mnist(_eval_batch_size(num_test), "test", data_dir=args.data_dir)
    source = args.data_dir or "the bundled 5,000-image sample"
    steps = args.sink_size if args.sink_size > 0 and not args.no_sink else len(train_set)
    print(
        f"LeNet5 on MNIST from {source}: {len(train_set) * args.batch_size} training images in "
        f"batches of {args.batch_size}, {num_test} test images; {args.epochs} epochs of {steps} "
        f"steps, {'no sink' if args.no_sink else f'sink_size={args.sink_size}'}, on "
        f"{sinkax.context.default_device()}",
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
    )
    callbacks = [LossMonitor(), TimeMonitor()]
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
