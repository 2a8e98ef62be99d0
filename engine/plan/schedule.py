"""When to validate and when to stop: Lightning's rules as pure functions of the config and a
few counters.

The Trainer's loop, :class:`~engine.listeners.ModelCheckpoint` and
:class:`~engine.listeners.EarlyStopping` all ask these, so the schedule is written once. The
counters are Lightning's: ``epoch`` is ``trainer.current_epoch`` (completed epochs),
``global_step`` the optimizer steps taken, ``batch_idx`` the training batch within the epoch,
``total_batch_idx`` the training batches before this one across epochs, and
``num_training_batches`` / ``num_val_batches`` the batches per epoch after the limits (an
unsized loader has ``inf`` training batches; ``num_val_batches`` is the total over the
validation loaders).
"""

from __future__ import annotations

import math

from engine.plan.config import LoopConfig

__all__ = [
    "can_stop_early",
    "checks_at_train_epoch_end",
    "epoch_done",
    "fit_done",
    "saves_at_train_epoch_end",
    "should_validate",
    "val_check_batch",
    "validates_this_epoch",
    "validation_follows",
]

INF = math.inf


def val_check_batch(
    config: LoopConfig, num_training_batches: float, enable_validation: bool
) -> float:
    """Validate after every this many training batches (``inf``: at the end of the data).

    Lightning's ``val_check_batch``: an int ``val_check_interval`` counts batches as given;
    a fraction of an epoch is ``max(1, int(num_training_batches * val_check_interval))``;
    with an unsized loader only 1.0 (``inf``, the end of the data) or an int work.

    Raises:
        ValueError: an int interval longer than the epoch while epochs count
            (``check_val_every_n_epoch`` not ``None``) and validation is on (Lightning raises
            whether or not it is on); a fraction other than 1.0 with an unsized loader.

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> schedule.val_check_batch(resolve(val_check_interval=0.25), 10, True)
        2
        >>> schedule.val_check_batch(resolve(), float("inf"), True)
        inf
        >>> schedule.val_check_batch(resolve(val_check_interval=3), 2, False)
        3
    """
    interval = config.val_check_interval
    if isinstance(interval, int):
        if (
            interval > num_training_batches
            and config.check_val_every_n_epoch is not None
            and enable_validation
        ):
            raise ValueError(
                f"Trainer(val_check_interval={interval}) must be at most the "
                f"number of training batches ({num_training_batches}); set "
                "check_val_every_n_epoch=None to count batches across epochs, or "
                "limit_val_batches=0 to turn validation off"
            )
        return interval
    if num_training_batches == INF:
        if interval != 1.0:
            raise ValueError(
                f"Trainer(val_check_interval={interval}): with a training "
                "dataloader without a length, pass 1.0 (at the end of the data) or an int"
            )
        return INF
    return max(1, int(num_training_batches * interval))


def validates_this_epoch(config: LoopConfig, epoch: int, enable_validation: bool) -> bool:
    """Whether this epoch has validation checks at all.

    Lightning's ``_should_check_val_epoch``: validation is on (there are validation batches)
    and ``check_val_every_n_epoch`` is ``None`` (batches are counted across epochs) or divides
    ``epoch + 1``.

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> every_2 = resolve(check_val_every_n_epoch=2)
        >>> [schedule.validates_this_epoch(every_2, e, True) for e in range(4)]
        [False, True, False, True]
        >>> schedule.validates_this_epoch(resolve(), 0, enable_validation=False)
        False
    """
    every = config.check_val_every_n_epoch
    return enable_validation and (every is None or (epoch + 1) % every == 0)


def can_stop_early(config: LoopConfig, epoch: int, global_step: int) -> bool:
    """Whether a stop request may end the fit now.

    Lightning's ``FitLoop._can_stop_early``: ``min_epochs`` completed epochs and
    ``min_steps`` optimizer steps, each when set (``min_steps`` alone implies
    ``min_epochs=1``).

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(min_epochs=2)
        >>> schedule.can_stop_early(config, 1, 50), schedule.can_stop_early(config, 2, 50)
        (False, True)
        >>> schedule.can_stop_early(resolve(min_steps=10), 1, 9)
        False
    """
    met_epochs = epoch >= config.min_epochs if config.min_epochs else True
    met_steps = global_step >= config.min_steps if config.min_steps else True
    return met_epochs and met_steps


def should_validate(
    config: LoopConfig,
    *,
    val_check_batch: float,
    batch_idx: int,
    total_batch_idx: int,
    is_last: bool,
    should_stop: bool = False,
    epoch: int = 0,
    global_step: int = 0,
) -> bool:
    """Whether validation runs after this training batch, in an epoch that validates
    (:func:`validates_this_epoch`).

    Lightning's ``_TrainingEpochLoop._should_check_val_fx``: the last batch of an epoch
    validates when ``val_check_batch`` is ``inf`` (at the end of the data); a stop that may
    end the fit (:func:`can_stop_early`) validates first; otherwise every ``val_check_batch``
    batches, counted within the epoch (``batch_idx``), or across epochs (``total_batch_idx``)
    when ``check_val_every_n_epoch`` is ``None``. A finite ``val_check_batch`` that does not
    divide the epoch leaves its last batch without validation.

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(val_check_interval=0.5)
        >>> vcb = schedule.val_check_batch(config, 5, True)
        >>> [b for b in range(5) if schedule.should_validate(
        ...     config, val_check_batch=vcb, batch_idx=b, total_batch_idx=b, is_last=b == 4)]
        [1, 3]
        >>> schedule.should_validate(config, val_check_batch=vcb, batch_idx=0,
        ...                          total_batch_idx=0, is_last=False, should_stop=True)
        True
    """
    if is_last and val_check_batch == INF:
        return True
    if should_stop and can_stop_early(config, epoch, global_step):
        return True
    if val_check_batch == INF:
        return False
    i = total_batch_idx if config.check_val_every_n_epoch is None else batch_idx
    return (i + 1) % val_check_batch == 0


def epoch_done(
    config: LoopConfig, *, global_step: int, should_stop: bool = False, epoch: int = 0
) -> bool:
    """Whether the training epoch ends after this batch, before its data does.

    Lightning's ``_TrainingEpochLoop.done``: ``max_steps`` reached (-1: no limit), or a stop
    request that may end the fit (:func:`can_stop_early`).

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(max_steps=5)
        >>> schedule.epoch_done(config, global_step=4), schedule.epoch_done(config, global_step=5)
        (False, True)
        >>> schedule.epoch_done(resolve(min_epochs=1), global_step=3, should_stop=True, epoch=0)
        False
    """
    if 0 <= config.max_steps <= global_step:
        return True
    return should_stop and can_stop_early(config, epoch, global_step)


def fit_done(
    config: LoopConfig, *, epoch: int, global_step: int, should_stop: bool = False
) -> bool:
    """Whether the fit ends before starting another epoch.

    Lightning's ``FitLoop.done``: ``max_steps`` or ``max_epochs`` reached (-1: no limit), or
    a stop request that may end the fit (:func:`can_stop_early`). (An epoch without training
    batches ends the fit too; the loop sees that when it counts them. ``max_time`` is the
    :class:`~engine.listeners.Timer`'s stop request.)

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(max_epochs=2)
        >>> schedule.fit_done(config, epoch=1, global_step=10)
        False
        >>> schedule.fit_done(config, epoch=2, global_step=10)
        True
        >>> schedule.fit_done(resolve(max_steps=8), epoch=1, global_step=8)
        True
    """
    if 0 <= config.max_steps <= global_step:
        return True
    if 0 <= config.max_epochs <= epoch:
        return True
    return should_stop and can_stop_early(config, epoch, global_step)


def saves_at_train_epoch_end(config: LoopConfig, num_val_batches: float) -> bool:
    """Where :class:`~engine.listeners.ModelCheckpoint` makes its epoch-wise saves when
    ``save_on_train_epoch_end`` is ``None``: at the end of the training epoch (``True``) or
    after validation.

    Lightning's ``ModelCheckpoint._should_save_on_train_epoch_end``: not when validation is
    every n > 1 epochs (or counted across epochs); yes without validation batches; otherwise
    when validation runs once, at the epoch's end (``val_check_interval == 1.0``, which holds
    for the int 1 too, as in Lightning).

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> schedule.saves_at_train_epoch_end(resolve(), num_val_batches=4)
        True
        >>> schedule.saves_at_train_epoch_end(resolve(val_check_interval=0.5), 4)
        False
        >>> schedule.saves_at_train_epoch_end(resolve(val_check_interval=0.5), 0)
        True
        >>> schedule.saves_at_train_epoch_end(resolve(check_val_every_n_epoch=2), 0)
        False
    """
    if config.check_val_every_n_epoch != 1:
        return False
    if num_val_batches == 0:
        return True
    return bool(config.val_check_interval == 1.0)


def validation_follows(
    config: LoopConfig,
    *,
    batch_idx: int,
    num_training_batches: float,
    num_val_batches: float,
    epoch: int,
) -> bool:
    """Whether this is the epoch's last training batch and validation is due this epoch:
    :class:`~engine.listeners.ModelCheckpoint` then defers a step-wise save of a monitored
    metric to after that validation (the metric would be stale).

    Lightning's ``ModelCheckpoint.on_train_batch_end`` (2.6): the last batch of an epoch that
    validates (:func:`validates_this_epoch`). It reads the epoch's schedule, not the batch's:
    with a ``val_check_batch`` that does not divide the epoch, no validation follows the last
    batch and the save waits for the next one.

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> config = resolve(check_val_every_n_epoch=2)
        >>> [schedule.validation_follows(config, batch_idx=3, num_training_batches=4,
        ...                              num_val_batches=2, epoch=e) for e in (0, 1)]
        [False, True]
        >>> schedule.validation_follows(config, batch_idx=2, num_training_batches=4,
        ...                             num_val_batches=2, epoch=1)
        False
    """
    if batch_idx + 1 != num_training_batches:
        return False
    return validates_this_epoch(config, epoch, num_val_batches > 0)


def checks_at_train_epoch_end(config: LoopConfig, num_val_batches: float) -> bool:
    """Where :class:`~engine.listeners.EarlyStopping` checks when ``check_on_train_epoch_end``
    is ``None``: at the end of the training epoch (``True``) or after each validation.

    Lightning's ``EarlyStopping.setup``: at the epoch's end when validation runs once per
    epoch, at its end (``val_check_interval == 1.0`` and ``check_val_every_n_epoch == 1``).
    Two differences, decided when fitting starts: without validation batches, at the epoch's
    end (there is no validation to check after); and the int 1 (validate after every batch)
    is not "once per epoch" (Lightning compares ``1 == 1.0``).

    Example:
        >>> from engine.plan import schedule
        >>> from engine.driver.resolve import resolve
        >>> schedule.checks_at_train_epoch_end(resolve(), num_val_batches=2)
        True
        >>> schedule.checks_at_train_epoch_end(resolve(val_check_interval=1), 2)
        False
        >>> schedule.checks_at_train_epoch_end(resolve(check_val_every_n_epoch=3), 0)
        True
    """
    if num_val_batches == 0:
        return True
    interval = config.val_check_interval
    return isinstance(interval, float) and interval == 1.0 and config.check_val_every_n_epoch == 1
