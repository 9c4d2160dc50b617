"""Checkpoints of a training run: :class:`ModelCheckpoint`, with orbax.

A checkpoint holds the train state, the epoch and step, and the data position
(:meth:`sinkax.Sink.data_state`), so a resumed run continues with exactly the next batch. It is
restored only into a state of the same layout (:func:`layout`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sinkax import context, distributed
from sinkax.errors import warn
from sinkax.train import checks
from sinkax.train.callbacks import Callback, RunContext
from sinkax.train.steps import TrainState


def layout(tree: Any) -> list[list[Any]]:
    """``[path, shape, dtype]`` of every leaf: what a checkpoint must match to be restored.

    >>> layout({"w": np.zeros((2, 3), np.float32)})
    [["['w']", [2, 3], 'float32']]
    """
    return [
        [jax.tree_util.keystr(path), list(np.shape(leaf)), str(jnp.result_type(leaf))]
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _layout_mismatch(saved: list[list[Any]], current: list[list[Any]]) -> list[str]:
    saved_by_path = {path: (shape, dtype) for path, shape, dtype in saved}
    current_by_path = {path: (shape, dtype) for path, shape, dtype in current}
    problems = [f"{p}: only in the checkpoint" for p in saved_by_path if p not in current_by_path]
    problems += [f"{p}: not in the checkpoint" for p in current_by_path if p not in saved_by_path]
    problems += [
        f"{p}: shape {tuple(saved_by_path[p][0])} {saved_by_path[p][1]} in the checkpoint, "
        f"{tuple(s)} {d} in this model"
        for p, (s, d) in current_by_path.items()
        if p in saved_by_path and saved_by_path[p] != (s, d)
    ]
    return problems


def _field(path: str) -> str:
    """The top-level field a leaf's path (as :func:`layout` writes it) starts in.

    >>> _field(".opt_state[0].mu['w']"), _field("['w']")
    ('opt_state', '')
    """
    return re.match(r"\.?(\w*)", path)[1]


def _finite(tree: Any) -> bool:
    """Whether every float leaf of ``tree`` is finite (checked on the device, one bool read).

    >>> _finite({"w": np.array([1.0, np.nan])}), _finite({"step": 3})
    (False, True)
    """
    checks = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    return bool(jnp.all(jnp.stack(checks))) if checks else True


class ModelCheckpoint(Callback):
    """Saves the train state and the data position with orbax every ``save_every_epochs``,
    and, as MindSpore's does, at the end of training if its last epoch was not saved yet --
    unless a callback stopped the run (``TerminateOnNaN``): then the last checkpoint saved is
    the one to resume from. A state with a non-finite float is never saved (a warning says
    so), so the latest checkpoint, and the ``keep_last`` kept, are all finite.

    Each checkpoint (named by the global step) holds params, optimizer state, step, epoch and
    the sink's ``data_state()``; the last ``keep_last`` are kept. Resume with
    ``model.train(..., resume_from=directory)`` (or this object): training continues with
    exactly the next batch.

    >>> import tempfile
    >>> ModelCheckpoint(tempfile.mkdtemp(), keep_last=2).latest_step() is None
    True
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep_last: int = 5, save_every_epochs: int = 1
    ):
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(
                f"A checkpoint directory is a path (str or os.PathLike), got {directory!r:.80} "
                "(resume_from= takes the directory a ModelCheckpoint saved into, or that object)."
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep_last = checks.count("keep_last", keep_last)
        self.save_every_epochs = checks.count("save_every_epochs", save_every_epochs)
        self._manager: Any = None
        self._in_run = False  # entered as a callback: its __exit__ waits for pending saves
        self._completed: int | None = None  # the last epoch that ran to its end
        self._saved: int | None = None  # the step of the last save
        self._refused: int | None = None  # the step of the last state not saved: not finite

    def _open(self) -> Any:
        ocp = checks.optional("orbax.checkpoint", "ModelCheckpoint")
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=self.keep_last)
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "meta")
            )
        return self._manager

    def _close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def latest_step(self) -> int | None:
        """The global step of the newest checkpoint, or ``None`` if there is none (outside a run
        read from the directory now: another run may have saved since)."""
        if not os.path.isdir(self.directory):
            return None
        manager = self._open()
        if not self._in_run:  # in one, its own saves may be in flight: orbax's list has them
            manager.reload()
        return manager.latest_step()

    def on_train_begin(self, run: RunContext) -> None:
        context.check_folder("ModelCheckpoint", self.directory)  # before any training
        self._close()  # the directory read afresh: another run may have saved since
        latest = self.latest_step()
        if latest is not None and latest > run.step:
            self._meta(latest)  # another tool's is named as such
            raise ValueError(
                f"{self.directory} holds checkpoints up to step {latest}, beyond this run's "
                f"start (step {run.step}): they belong to another run. Resume from them with "
                "model.train(..., resume_from=directory), or save into an empty directory."
            )
        self._saved = latest  # a resumed run's first step: saved already

    def on_epoch_end(self, run: RunContext) -> None:
        self._completed = run.epoch
        if run.epoch % self.save_every_epochs == 0:
            self.save(run)

    def on_train_end(self, run: RunContext) -> None:
        # not after a stop request: that may be TerminateOnNaN's, and the state not worth keeping
        if not run.stop_requested and self._completed == run.epoch and self._saved != run.step:
            self.save(run)

    def __enter__(self) -> ModelCheckpoint:
        self._in_run = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._in_run = False
        self._close()  # pending writes finish, also when training failed after a save

    def save(self, run: RunContext) -> None:
        """Save now, unless this step is saved already: in a run whose callbacks hold this
        checkpointer asynchronously (the state is copied to the host first; the run's end waits
        for the write), else (a checkpointer kept by another callback) before returning. Within
        an epoch, the checkpoint records the epochs completed before it and the steps run of
        it: a run resumed from it finishes that epoch. A state with a non-finite float is not
        saved: a warning says so."""
        ocp = checks.optional("orbax.checkpoint", "ModelCheckpoint")
        if self._saved == run.step:  # e.g. by the user's callback, then at the epoch's end
            return
        if not _finite(run.state):
            if self._refused == run.step:  # said once
                return
            self._refused = run.step
            warn(
                f"ModelCheckpoint did not save step {run.step} (epoch {run.epoch}): its state is "
                "not finite (NaN or inf); the checkpoints saved before it are kept.",
                RuntimeWarning,
            )
            return
        state = jax.device_get(run.state)
        epochs, step_in_epoch = run.completed
        meta = {
            "epoch": epochs,
            "step_in_epoch": step_in_epoch,
            "step": run.step,
            "data_state": distributed.shared_position(run.data_state(), 2 * run.helper.timeout),
            "layout": layout(state),
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._open().save(run.step, args=args, force=True)
        if not self._in_run:  # no __exit__ waits for it
            self._open().wait_until_finished()
        self._saved = run.step

    def _meta(self, step: int) -> dict[str, Any]:
        """What checkpoint ``step`` says of itself; ``ValueError`` if it is none of a
        ModelCheckpoint's (another tool's orbax checkpoint)."""
        ocp = checks.optional("orbax.checkpoint", "ModelCheckpoint")
        try:
            read = self._open().restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            missing = "layout" if "layout" not in read["meta"] else None
        except KeyError as error:
            missing = error.args[0]
        if missing is not None:
            raise ValueError(
                f"{self.directory} (step {step}) holds no checkpoint of sinkax's "
                f"ModelCheckpoint (missing: {missing}): resume from a directory a "
                "ModelCheckpoint saved into, or save into an empty one."
            )
        return read["meta"]

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)`` of checkpoint ``step`` (default: the latest), shaped like ``like``.

        Raises ``ValueError`` naming the differing leaves if the checkpoint was written by a
        model with another params or optimizer-state layout. An eval-only model's state (a
        :class:`~sinkax.train.TrainState` without ``opt_state``) takes a training checkpoint's
        other fields, its optimizer state left out.
        """
        ocp = checks.optional("orbax.checkpoint", "ModelCheckpoint")
        self._close()  # pending saves finish first
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.directory} to resume from.")
        try:
            meta = self._meta(step)
            saved_layout = meta["layout"]
            eval_only = isinstance(like, TrainState) and like.opt_state is None
            if eval_only:  # it takes neither the optimizer state nor, if it has none, a key
                left_out = {"opt_state", *(["rng"] if like.rng is None else [])}
                saved_layout = [leaf for leaf in saved_layout if _field(leaf[0]) not in left_out]
            problems = _layout_mismatch(saved_layout, layout(like))
            if problems:
                more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
                raise ValueError(
                    f"The checkpoint {self.directory} (step {step}) was written by a different "
                    f"model and cannot be restored into this one: {'; '.join(problems[:5])}{more}."
                    " Resume with the network and optimizer it was trained with, or train from "
                    "scratch."
                )

            def abstract(x: Any) -> jax.ShapeDtypeStruct:
                return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))

            if eval_only:
                fields = {k: v for k, v in like._asdict().items() if k not in left_out}
                item = ocp.args.PyTreeRestore(jax.tree.map(abstract, fields), partial_restore=True)
                restored = self._open().restore(step, args=ocp.args.Composite(state=item))
                return like._replace(**restored["state"]), meta
            args = ocp.args.Composite(state=ocp.args.StandardRestore(jax.tree.map(abstract, like)))
            return self._open().restore(step, args=args)["state"], meta
        finally:
            self._close()
