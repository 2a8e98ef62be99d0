"""Loggers: where the Trainer sends host-side metrics and hyperparameters.

The Trainer calls ``log_metrics(metrics, step)`` on each of its loggers (any number, in order),
``log_hyperparams(params)`` once per run and ``finalize(status)`` at the end.
:class:`TensorBoardLogger` writes TensorBoard event files with tensorboardX; :class:`CSVLogger`
writes ``metrics.csv`` and ``hparams.yaml``. Both use Lightning's run directories,
``save_dir/name/version_N``. :class:`MLFlowLogger` and :class:`WandbLogger` send them to an
MLflow tracking store and to Weights & Biases (the ``engine[mlflow]`` and ``engine[wandb]``
extras; neither package is imported until such a logger is used). Subclass :class:`Logger`
for your own.

Example:
    >>> import tempfile
    >>> from engine.loggers import CSVLogger, TensorBoardLogger
    >>> root = tempfile.mkdtemp()
    >>> loggers = [TensorBoardLogger(root), CSVLogger(root)]
    >>> [lg.log_dir == loggers[0].log_dir for lg in loggers]  # one run directory
    [True, True]
"""

from engine.loggers.base import Logger
from engine.loggers.csv import CSVLogger
from engine.loggers.mlflow import MLFlowLogger
from engine.loggers.tensorboard import TensorBoardLogger
from engine.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
