"""The recorded run, loaded for a replay: its task, model structure and data (unpickled: trusted
runs only, from the run directory's own files), the Trainer flags that decide what its steps
compute (:func:`_flags`), and a DP-SGD run's transform (:func:`_privacy`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.checkpoint._data import references
from engine.checkpoint._pickling import Rebuild, load_skeleton, loads_code
from engine.listeners.journal import CONFIG, DATA, MODEL, TASK
from engine.replaying._journal import _run_file
from engine.replaying._report import ReplayError

# the Trainer flags that decide what the training steps compute (the rest only observe)
_REPLAYED_FLAGS = (
    "limit_train_batches",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "deterministic",
    "inference_mode",
    "reload_dataloaders_every_n_epochs",
    "compile",
    "sync_batchnorm",
    "use_distributed_sampler",
)


def _load_run(
    root: Path, data: Any
) -> tuple[Any, bytes, Any, dict[str, Any], tuple[str, ...], int | None]:
    """Unpickle the task and the data (runs code: trusted runs only) and read the model's
    pickled structure; read the flags that decide what a step computes. Then the calls that
    made the data again (``data.pkl``'s references, :mod:`engine.checkpoint._data`) and the
    run's thread count (:func:`_threads`)."""
    for name in (TASK, MODEL):
        if not (root / name).is_file():
            raise ReplayError(
                f"{root / name} is missing: the run was journaled with Journal(replayable=False) "
                "or its task could not be pickled (see the warning of that run)"
            )
    task = loads_code(_run_file(root, TASK, "the task").read_bytes())
    if task.tx is None:
        raise ReplayError(
            f"{root / TASK}: the task has a step_fn and no tx, so the optimizer state's "
            "structure cannot be rebuilt; give Task(step_fn=..., tx=...) to replay its runs"
        )
    model = _run_file(root, MODEL, "the model").read_bytes()
    load_skeleton(model, task.tx)  # fails here, before any step, if it cannot be rebuilt
    rebuilt: tuple[str, ...] = ()
    if data is None:
        if not (root / DATA).is_file():
            raise ReplayError(
                f"{root / DATA} is missing (the data source did not pickle, or was larger than "
                "Journal(max_data_bytes=...)); pass the training data as replay(..., data=...)"
            )
        payload = _run_file(root, DATA, "the data").read_bytes()
        rebuilt = tuple(text for _, text in references(payload))
        data = loads_code(payload)  # a dataset recorded by reference is made again here
        if isinstance(data, Rebuild):  # a datamodule recorded as its class and hyperparameters
            data = data()
    config_path = root / CONFIG
    config = (
        json.loads(_run_file(root, CONFIG, "the config").read_text())
        if config_path.is_file()
        else {}
    )
    return task, model, data, _flags(config), rebuilt, _threads(config)


def _threads(config: dict[str, Any]) -> int | None:
    """The run's ``torch.get_num_threads()`` (``config.json``'s ``threads``; ``None`` for a run
    journaled before it was recorded): a CPU reduction sums per-thread parts, so the replay
    computes with the run's count to compute the run's bits."""
    threads = config.get("threads")
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ReplayError(f"config.json: threads={threads!r} is not a thread count (an int >= 1)")
    return threads


def _privacy(ckpt: Any) -> Any:
    """The DP-SGD transform of a run whose checkpoint holds DP-SGD's numbers
    (``extra["dpsgd"]``), built with them; ``None`` for any other run. ``chunk_size`` (how
    many examples are vectorised at once) is not recorded: replay runs each micro-batch whole."""
    from engine import checkpoint
    from engine.privacy import DPSGD, KEY

    held = (checkpoint.read_meta(ckpt).get("trees") or {}).get("extra", {}).get(KEY)
    if not isinstance(held, dict):
        return None
    names = ("max_grad_norm", "noise_multiplier", "sample_rate", "expected_batch_size")
    try:
        return DPSGD(**{k: held[k] for k in names})
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{ckpt}: extra['dpsgd'] does not describe a DP-SGD run: {e}") from e


def _flags(config: dict[str, Any]) -> dict[str, Any]:
    """The Trainer flags of the recorded run that decide what its steps compute: those of
    ``_REPLAYED_FLAGS``, its precision and the device it ran on (the one resolved then)."""
    from engine.transforms import PRECISIONS

    flags = {k: config[k] for k in _REPLAYED_FLAGS if k in config}
    blocks = config.get("steps_per_call", 1)
    if flags.get("compile") and isinstance(blocks, int) and blocks > 1:
        # eager, a block is its single steps (replayed one by one, bitwise); compiled, it is
        # one graph, which single compiled steps match only within tolerance: the replay runs
        # the journaled blocks again (_Checker.block_starts)
        flags["steps_per_call"] = blocks
    precision = config.get("precision")
    if precision is not None:  # absent or None: a run before precisions, in float32
        if precision not in PRECISIONS and precision not in (32, "32"):
            raise ReplayError(
                f"the run's precision was the plugin {precision}, which replay cannot rebuild "
                "from config.json; replay runs with precision flags such as 'bf16-mixed'"
            )
        flags["precision"] = precision
    device = config.get("device")
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        flags["accelerator"] = kind
        flags["devices"] = [int(index)] if index else 1
    world = config.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ReplayError(f"config.json: world_size={world!r} is not a number of ranks (>= 1)")
    if world > 1:  # as many ranks again, here: gloo processes on this machine's CPU
        if flags.get("accelerator", "cpu") != "cpu":
            raise ReplayError(
                f"the run had {world} data-parallel ranks on {device}; replay re-executes a "
                "data-parallel run on CPU processes only (gloo), whose arithmetic is not that "
                "of the accelerator's collectives: replay a CPU run, or a one-device run"
            )
        # the same kind of strategy: a sharded state's arithmetic (gathers, reduce-scatters)
        # is FSDP's, and its checkpoints are shards
        strategy = "fsdp" if config.get("sharded") is True else "ddp"
        flags.update(accelerator="cpu", strategy=strategy, devices=world, num_nodes=1)
    return flags
