"""A tiny fit into given loggers, shared by the MLflow and W&B logger tests (a module of its
own: importing either test file would skip the other's tests without its package)."""

from __future__ import annotations

from pathlib import Path


def tiny_fit(
    loggers,
    root: Path,
    *,
    max_steps: int = 6,
    callbacks=(),
    fail_at: int | None = None,
    ckpt_path: str | None = None,
    model=None,
):
    """A tiny fit (4 batches, validation every 2 steps, a row every step) into ``loggers``
    (the W&B tests' too); ``fail_at``: a step that raises."""
    import torch
    import torch.nn.functional as F

    import engine as eg
    from engine import optim

    class Fail(eg.Listener):
        def on_train_batch_end(self, rec):
            if rec.state.step == fail_at:
                raise RuntimeError("failed on purpose")

    def loss(m, b):
        return F.mse_loss(m(b[0]), b[1])

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    hparams = {"lr": 0.05, "model": {"width": 4, "act": None}, "betas": (0.9, 0.99)}
    task = eg.Task(loss, optim.adamw(0.05), eval_fn=loss, hparams=hparams)
    trainer = eg.Trainer(
        max_steps=max_steps,
        log_every_n_steps=1,
        val_check_interval=2,
        logger=loggers,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Fail(), *callbacks],
    )
    model = model or torch.nn.Linear(4, 1)
    trainer.fit(task, task.init(model), data, data[:2], ckpt_path=ckpt_path)
    return trainer
