"""``engine fit`` / ``validate`` / ``test`` / ``predict``: a run described by config files and
``--key=value`` overrides, parsed with jsonargparse as LightningCLI parses its own.

The config's sections: ``trainer`` (the :class:`~engine.Trainer`'s flags), ``model`` (an
``nn.Module``), ``task`` (an :class:`~engine.Task`), ``data`` (a datamodule), ``seed_everything``
and ``ckpt_path``; ``model``, ``task`` and ``data`` are ``class_path`` + ``init_args`` of a class,
or of a function annotated to return one. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any, Protocol, Union

import attrs
import torch
from torch import nn

from engine.cli import _checks as checks
from engine.errors import CheckpointError

__all__ = ["STAGES", "Built", "build", "build_parser", "run"]

STAGES = {
    "fit": "train a model described by config files (LightningCLI's fit)",
    "validate": "run one validation epoch on a checkpoint's weights",
    "test": "run one test epoch on a checkpoint's weights",
    "predict": "run prediction on a checkpoint's weights",
}

_CKPT_HELP = {
    "fit": 'a checkpoint to resume from: a path, or "last" (the newest under the run\'s root)',
    "validate": "the checkpoint whose weights to validate",
    "test": "the checkpoint whose weights to test",
    "predict": "the checkpoint whose weights predict",
}


# A datamodule serves at least one of these (engine's duck-typed DataModule protocol, which a
# LightningDataModule satisfies); jsonargparse checks a data class_path against their union.
class _TrainData(Protocol):
    def train_dataloader(self): ...


class _ValData(Protocol):
    def val_dataloader(self): ...


class _TestData(Protocol):
    def test_dataloader(self): ...


class _PredictData(Protocol):
    def predict_dataloader(self): ...


_DataModule = Union[_TrainData, _ValData, _TestData, _PredictData]  # noqa: UP007 (a runtime type)


# the datamodule method each stage reads its batches from
_LOADER = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


def _path(value: Any) -> str:
    """jsonargparse's reading of an ``os.PathLike`` key: a path is text. Without this it turns
    any value into its ``str()`` (``[a, b]`` -> ``"['a', 'b']"``, ``null`` -> ``"None"``)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a path, got {type(value).__name__} {value!r}")
    return value


def build_parser(stage: str) -> Any:
    """The jsonargparse parser of ``engine STAGE``; it raises ``argparse.ArgumentError`` on a
    bad key or value (``run`` prints it as one ``error:`` line)."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings
    from jsonargparse.typing import register_type

    from engine.events import Listener
    from engine.loggers import Logger
    from engine.task import Task
    from engine.trainer import Trainer

    # Task is an attrs class, whose subclasses jsonargparse refuses by default; a class_path may
    # name a Task subclass or a function returning a Task
    set_parsing_settings(subclasses_enabled=[Task])
    register_type(os.PathLike, serializer=os.fspath, deserializer=_path)
    parser = ArgumentParser(
        prog=f"engine {stage}",
        description=f"{STAGES[stage]}; the config keys are described in docs/cli.md",
        usage=f"engine {stage} [--config CONFIG.yaml ...] [--KEY=VALUE ...] [--print_config]",
        allow_abbrev=False,  # --trainer.max_epoch must not silently mean --trainer.max_epochs
        default_env=False,
        exit_on_error=False,  # run() prints the error in one line
        parser_mode=checks.install_yaml_loader(),  # YAML bounded in size and alias expansion
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="a YAML config file; give several and the later ones win, as do --KEY=VALUE",
    )
    parser.add_argument(
        "--seed_everything",
        type=int,
        default=0,
        help="seeds torch, random and numpy before the model is built, and the TrainState",
    )
    parser.add_class_arguments(
        Trainer,
        "trainer",
        instantiate=False,  # built by run(), so that its own errors name the flag
        skip={"callbacks", "logger"},
        fail_untyped=False,
    )
    parser.add_argument(
        "--trainer.callbacks",
        type=Union[list[Listener], Listener, None],  # noqa: UP007
        default=None,
        help="listeners: class_path + init_args each (--trainer.callbacks+=CLASS to append)",
    )
    parser.add_argument(
        "--trainer.logger",
        type=Union[bool, Logger, list[Logger], None],  # noqa: UP007
        default=None,
        help="true (TensorBoard), false, or loggers as class_path + init_args",
    )
    parser.add_argument(
        "--model",
        type=nn.Module,
        required=True,
        help="the nn.Module: class_path (or a function returning one) and init_args",
    )
    parser.add_argument(
        "--task",
        type=Task,
        required=True,
        help="the engine.Task: a function returning one (class_path) and its init_args",
    )
    parser.add_argument(
        "--data",
        type=_DataModule,
        required=True,
        help="a datamodule (a class with train_dataloader() and the like): class_path, init_args",
    )
    parser.add_argument("--ckpt_path", type=Union[str, None], default=None, help=_CKPT_HELP[stage])  # noqa: UP007
    if stage == "predict":
        parser.add_argument(
            "--predictions_path",
            type=Union[str, None],  # noqa: UP007
            default=None,
            help="save the predictions there with torch.save (a list of each batch's outputs)",
        )
    return parser


def seed_everything(seed: int) -> None:
    """Seed the global generators the model's initial weights and the data may draw from."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        return
    np.random.seed(seed % 2**32)


def _error(message: str) -> int:
    print(f"error: {checks.one_line(message)}", file=sys.stderr)
    return 2


@attrs.frozen
class Built:
    """What ``engine STAGE`` builds from its config files and overrides, before it runs
    anything (LightningCLI's ``run=False``): see :func:`build`.

    Attributes:
        trainer: the :class:`~engine.Trainer` of the config's ``trainer`` section.
        model: the ``model`` section's module.
        task: the ``task`` section's :class:`~engine.Task`.
        state: ``task.init(model, seed=seed)``: the state a fit starts from.
        datamodule: the ``data`` section's datamodule.
        ckpt_path: ``--ckpt_path`` (``None`` when not given).
        seed: ``seed_everything`` (the global generators were seeded with it before the model
            was built).
        config: the parsed config (jsonargparse's namespace), as ``--print_config`` shows it.
    """

    trainer: Any
    model: Any
    task: Any
    state: Any
    datamodule: Any
    ckpt_path: Any
    seed: int
    config: Any


class _Refused(Exception):
    """A bad key or value: ``run`` prints its one ``error:`` line and exits 2."""


def _build(stage: str, argv: list[str]) -> tuple[Built, Any]:
    """Parse ``argv`` for ``engine STAGE`` and build the pieces; raises :class:`_Refused`
    with the one line to print for a bad key or value."""
    from engine.trainer import Trainer

    too_large = checks.check_config_files(argv)
    if too_large:
        raise _Refused(too_large)
    parser = build_parser(stage)
    try:
        cfg = parser.parse_args(argv)  # --print_config prints and exits 0 in here
    except argparse.ArgumentError as e:
        raise _Refused(f"{e} (engine {stage} --help lists the keys)") from e
    trainer_cfg = cfg.trainer.as_dict() if hasattr(cfg.trainer, "as_dict") else dict(cfg.trainer)
    problem = (
        checks.check_seed(cfg.seed_everything)
        or checks.check_ints("trainer", trainer_cfg)
        or checks.check_root_dir(trainer_cfg.get("default_root_dir"))
    )
    if problem:
        raise _Refused(problem)
    seed = int(cfg.seed_everything)
    seed_everything(seed)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    try:
        init = instantiate(cfg)
    except Exception as e:  # a listener or logger refusing its init_args, as jsonargparse says
        if not checks.refusal(e):
            raise
        raise _Refused(str(e)) from e
    flags = init.trainer.as_dict() if hasattr(init.trainer, "as_dict") else dict(init.trainer)
    try:
        trainer = Trainer(**flags)
    except (TypeError, ValueError) as e:
        raise _Refused(f"trainer: {e}") from e
    model, task, data, ckpt_path = init.model, init.task, init.data, init.ckpt_path
    needed = _LOADER[stage]
    if not callable(getattr(data, needed, None)):
        raise _Refused(
            f"data: {type(data).__module__}.{type(data).__qualname__} has no {needed}() "
            f"method, which engine {stage} reads its batches from; give data.class_path a "
            "class that has one"
        )
    if ckpt_path not in (None, "last", "best") and not os.path.exists(ckpt_path):
        raise _Refused(f"ckpt_path: {ckpt_path!r} does not exist")
    state = task.init(model, seed=seed)
    return Built(trainer, model, task, state, data, ckpt_path, seed, cfg), init


def build(argv: list[str] | None = None, *, stage: str = "fit") -> Built:
    """Build the trainer, model, task, state and datamodule from config files and
    ``--KEY=VALUE`` overrides as ``engine STAGE`` does, and run nothing: LightningCLI's
    ``run=False``, for a script that then calls them (a fit, then a test and a prediction of
    its best checkpoint, say). docs/cli.md shows such a script.

    Args:
        argv: the arguments (``sys.argv[1:]`` when ``None``): ``--config FILE``, overrides,
            ``--ckpt_path``; ``--help`` and ``--print_config`` print and exit, as the command.
        stage: whose keys to parse: ``"fit"`` (default), ``"validate"``, ``"test"`` or
            ``"predict"`` (which adds ``--predictions_path``).

    Raises:
        SystemExit: status 2 after printing one ``error:`` line for a bad key or value (a
            command-line tool's behaviour, as LightningCLI's parser's); 0 after ``--help``.
        ValueError: for another ``stage``.

    Example:
        >>> from engine.cli import build
        >>> build(["--trainer.max_epoch=3"])  # a misspelt key: one error line, status 2
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    if stage not in STAGES:
        raise ValueError(f"build(stage={stage!r}): pass one of {', '.join(STAGES)}")
    try:
        built, _ = _build(stage, sys.argv[1:] if argv is None else list(argv))
    except _Refused as e:
        _error(str(e))
        raise SystemExit(2) from None
    return built


def run(stage: str, argv: list[str]) -> int:
    """Parse ``argv`` for ``engine STAGE``, build the pieces and run the stage; the exit status.

    A bad key or value, a flag the Trainer refuses, or a refusal engine raises while the stage
    runs (a flag that does not fit the data) exits 2 with one ``error:`` line. An exception
    from the user's own code keeps its traceback.
    """
    try:
        built, init = _build(stage, argv)
    except _Refused as e:
        return _error(str(e))
    ckpt_path = built.ckpt_path
    try:
        return _run_stage(
            stage, built.trainer, built.task, built.state, built.datamodule, ckpt_path, init
        )
    except CheckpointError as e:  # a damaged or mismatched checkpoint, a save that failed
        return _error(f"{'ckpt_path' if ckpt_path is not None else stage}: {e}")
    except Exception as e:  # engine refusing a flag that does not fit the data, say
        if not checks.refusal(e):
            raise
        return _error(f"{stage}: {e}")


def _run_stage(
    stage: str, trainer: Any, task: Any, state: Any, data: Any, ckpt_path: Any, init: Any
) -> int:
    zero = trainer.is_global_zero  # one report for the run, from rank 0
    if stage == "fit":
        state = trainer.fit(task, state, datamodule=data, ckpt_path=ckpt_path)
        if zero:
            _report_fit(trainer, state)
        return 0
    if ckpt_path is None and zero:
        print(
            f"warning: engine {stage} without --ckpt_path uses the model's initial weights",
            file=sys.stderr,
        )
    if stage in ("validate", "test"):
        method = trainer.validate if stage == "validate" else trainer.test
        results = method(task, state, datamodule=data, ckpt_path=ckpt_path)
        if trainer.barebones and zero:  # the Trainer prints nothing then
            print(results)
        return 0
    outputs = trainer.predict(task, state, datamodule=data, ckpt_path=ckpt_path)
    path = init.predictions_path
    if path is not None and trainer.world_size > 1:  # each rank predicted its shard
        stem, dot, suffix = path.rpartition(".")
        rank = f"rank{trainer.global_rank}"
        path = f"{stem}.{rank}.{suffix}" if dot else f"{path}.{rank}"
    _report_predict(outputs or [], path)
    return 0


def _report_fit(trainer: Any, state: Any) -> None:
    print(f"fit: {trainer.current_epoch} epochs, {state.step} optimizer steps")
    for name, value in sorted(trainer.callback_metrics.items()):
        print(f"  {name} = {float(value):.6g}")
    from engine.listeners import ModelCheckpoint

    savers = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    for saver in savers:
        if saver.best_model_path:
            print(f"best checkpoint: {saver.best_model_path}")
        if saver.last_model_path and saver.last_model_path != saver.best_model_path:
            print(f"last checkpoint: {saver.last_model_path}")
    if trainer.run_dir is not None:
        print(f"run directory: {trainer.run_dir} (engine replay {trainer.run_dir} --trust-code)")


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"Tensor{list(out.shape)} {str(out.dtype).removeprefix('torch.')}"
    if isinstance(out, (list, tuple)):
        return f"{type(out).__name__} of {len(out)}"
    if isinstance(out, dict):
        return f"dict with keys {sorted(map(str, out))}"
    return type(out).__name__


def _report_predict(outputs: list[Any], path: str | None) -> None:
    batches = outputs
    if outputs and isinstance(outputs[0], list):  # several dataloaders: a list per loader
        batches = [b for loader in outputs for b in loader]
    first = f"; the first batch's output: {_describe(batches[0])}" if batches else ""
    print(f"predict: {len(batches)} batches{first}")
    if path is not None:
        torch.save(outputs, path)
        print(f"predictions saved to {path} (torch.load({path!r}))")
