"""A run directory records the training data by reference where it can be made again (a
datamodule's or dataset's class and the arguments ``save_hyperparameters()`` recorded) and
pickles it where it must, warning once per class when that is large
(``engine.checkpoint._data``).

The classes below live in this module, which the tests import by name (``tests/`` is on the
path): pickling names them by reference, as it would a user's package."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import engine as eg
from engine import cli, optim
from engine.checkpoint import _data
from engine.checkpoint._data import LARGE, SMALL, references

FEATURES = 256
MiB = 2**20


class Sums:
    """A datamodule as Lightning's behave (a ``trainer`` attribute, the arguments it was made
    with as ``hparams``): ``n`` rows of ``FEATURES`` numbers from a seeded generator (4 MiB for
    ``n=4096``)."""

    def __init__(self, n: int = 4096, batch_size: int = 512, seed: int = 0) -> None:
        self.trainer = None
        self.hparams = {"n": n, "batch_size": batch_size, "seed": seed}
        x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
        self.train = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams["batch_size"], shuffle=True)


class Drawn(Sums):
    """Its rows come from the global random generator as it is made: its arguments do not make
    the same data again."""

    def __init__(self, n: int = 4096, batch_size: int = 512, seed: int = 0) -> None:
        super().__init__(n, batch_size, seed)
        x = torch.randn(n, FEATURES)  # the global generator's next numbers
        self.train = TensorDataset(x, x.sum(1, keepdim=True))


class Partial(Sums):
    """Its ``hparams`` leave out an argument (``save_hyperparameters(ignore=["scale"])``)."""

    def __init__(self, n: int = 4096, batch_size: int = 512, scale: float = 1.0) -> None:
        super().__init__(n, batch_size)
        self.hparams = {"n": n, "batch_size": batch_size}


class Rows(Dataset):
    """A dataset that records its arguments (``hparams``): ``n`` seeded rows."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.hparams = {"n": n, "seed": seed}
        self.x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.x[i].sum(0, keepdim=True)


@pytest.fixture(autouse=True)
def _warnings_not_yet_said(monkeypatch):
    """Each test starts with no class warned about in this process."""
    monkeypatch.setattr(_data, "_warned", set())


def _fit(root: Path, data=None, datamodule=None, epochs: int = 1) -> Path:
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(1e-3), lr=1e-3)
    trainer = eg.Trainer(
        max_epochs=epochs,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=root,
    )
    trainer.fit(task, task.init(torch.nn.Linear(FEATURES, 1)), data, datamodule=datamodule)
    return Path(trainer.run_dir)


def _said(caught, what: str) -> list[str]:
    return [str(w.message) for w in caught if what in str(w.message)]


def test_a_large_datamodule_with_hparams_is_recorded_by_reference_and_replays(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _fit(tmp_path, datamodule=Sums())
    payload = (run / "data.pkl").read_bytes()
    assert len(payload) < 64 * 2**10  # not the 4 MiB of rows
    assert references(payload) == [
        ("the data source", "test_data_by_reference.Sums(n=4096, batch_size=512, seed=0)")
    ]
    (said,) = _said(caught, "by reference, as")
    assert "test_data_by_reference.Sums" in said and "4.0 MiB" in said and "divergence" in said
    report = eg.replay(run, trust_code=True)
    assert report.identical and report.steps == 8, str(report)
    assert report.data_rebuilt == ("test_data_by_reference.Sums(n=4096, batch_size=512, seed=0)",)


def test_the_reference_is_said_once_for_two_fits(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path / "a", datamodule=Sums(n=1024, seed=1))
        _fit(tmp_path / "b", datamodule=Sums(n=1024, seed=2))
    assert len(_said(caught, "by reference, as")) == 1


def test_a_small_datamodule_is_pickled_whole_without_a_word(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _fit(tmp_path, datamodule=Sums(n=64, batch_size=16))
    payload = (run / "data.pkl").read_bytes()
    assert references(payload) == [] and len(payload) <= SMALL
    assert not _said(caught, "data.pkl")
    loaded = pickle.loads(pickle.loads(payload)[2])  # what a replay uses: the run's own rows
    assert torch.equal(loaded.train.tensors[0], Sums(n=64).train.tensors[0])


def test_a_datamodule_whose_class_is_not_importable_is_pickled_and_said_once(tmp_path):
    class Local(Sums):  # made in a function: no name to import it by
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _fit(tmp_path / "a", datamodule=Local(n=1200))
        _fit(tmp_path / "b", datamodule=Local(n=1200))
    payload = (run / "data.pkl").read_bytes()
    assert references(payload) == [] and len(payload) > LARGE  # its rows are in it
    assert not _said(caught, "by reference, as")
    (said,) = _said(caught, "of pickled data")
    assert "Local" in said and "cannot be imported by name" in said
    assert "save_hyperparameters()" in said


def test_a_datamodule_from_main_is_pickled(tmp_path):
    main = type("Main", (Sums,), {"__module__": "__main__"})
    assert _data.reference(main()) is None
    assert _data.reference(Sums()) is not None


def test_hparams_that_leave_out_an_argument_are_no_reference(tmp_path):
    assert _data.reference(Partial()) is None
    assert "did not record scale" in _data._unbound(Partial, Partial().hparams)
    with pytest.warns(UserWarning, match="did not record scale"):
        run = _fit(tmp_path, datamodule=Partial(n=1024))
    assert references((run / "data.pkl").read_bytes()) == []  # pickled: its rows are in it


def test_a_datamodule_drawing_from_the_global_generator_diverges_on_replay(tmp_path):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"records test_data_by_reference\.Drawn by reference"):
        run = _fit(tmp_path, datamodule=Drawn())
    assert references((run / "data.pkl").read_bytes())  # recorded by reference
    report = eg.replay(run, trust_code=True)  # Drawn() draws other rows now
    assert not report.identical and report.divergence is not None
    assert report.first_divergent_step == 1, str(report)
    assert "made again from data.pkl's reference: test_data_by_reference.Drawn(" in str(report)


def test_a_loader_over_a_large_tensor_dataset_is_pickled_and_said_once(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1500, FEATURES, generator=g)  # 1.5 MiB
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=500)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _fit(tmp_path / "a", loader)
        _fit(tmp_path / "b", loader)
    payload = (run / "data.pkl").read_bytes()
    assert references(payload) == [] and len(payload) > LARGE
    (said,) = _said(caught, "of pickled data")
    assert "torch.utils.data.dataset.TensorDataset" in said and "1.5 MiB" in said
    assert "no hparams" in said and "LightningDataModule" in said


def test_a_loader_over_a_dataset_with_hparams_records_the_dataset_by_reference(tmp_path):
    loader = DataLoader(Rows(4096, seed=3), batch_size=512, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _fit(tmp_path, loader)
    payload = (run / "data.pkl").read_bytes()
    assert len(payload) < 64 * 2**10
    assert references(payload) == [
        ("inside the pickle", "test_data_by_reference.Rows(n=4096, seed=3)")
    ]
    assert len(_said(caught, "by reference, as")) == 1
    from engine.checkpoint._pickling import loads_code

    loaded = loads_code(payload)  # the loader's own settings, its dataset made again
    assert (loaded.batch_size, loaded.drop_last) == (512, True)
    assert type(loaded.sampler).__name__ == "RandomSampler"
    assert torch.equal(loaded.dataset.x, loader.dataset.x)
    report = eg.replay(run, trust_code=True)
    assert report.identical and report.steps == 8, str(report)


def test_inspect_names_the_reference_or_the_pickle(tmp_path, capsys):
    with pytest.warns(UserWarning, match="by reference"):
        run = _fit(tmp_path / "a", datamodule=Sums(n=1024))
    assert cli.main(["inspect", str(run)]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if "data.pkl" in x)
    assert "by reference: test_data_by_reference.Sums(n=1024, batch_size=512, seed=0)" in line
    assert cli.main(["inspect", str(run), "--json"]) == 0
    data = {f["name"]: f for f in json.loads(capsys.readouterr().out)["files"]}["data.pkl"]
    assert data["recorded"] == "by reference"
    assert data["references"] == ["test_data_by_reference.Sums(n=1024, batch_size=512, seed=0)"]

    run = _fit(tmp_path / "b", datamodule=Sums(n=64, batch_size=16))
    assert cli.main(["inspect", str(run)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "data.pkl" in x)
    assert "pickled: test_data_by_reference.Sums, holding tensors" in line


def test_a_lightning_datamodule_with_save_hyperparameters_is_recorded_by_reference(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from _datamodules import LitRows, LitSums

    with pytest.warns(UserWarning, match=r"records _datamodules\.LitSums by reference"):
        run = _fit(tmp_path, datamodule=LitSums())
    payload = (run / "data.pkl").read_bytes()
    assert len(payload) < 64 * 2**10  # the 4 MiB its setup() made are not in it
    made_again = "_datamodules.LitSums(n=4096, batch_size=512)"
    assert references(payload) == [("the data source", made_again)]
    report = eg.replay(run, trust_code=True)
    assert report.identical and report.steps == 8, str(report)
    # a dataset recording its arguments with Lightning's HyperparametersMixin
    assert _data.reference(LitRows(8, seed=1)).description == "_datamodules.LitRows(n=8, seed=1)"


def test_the_warning_comes_once_data_pkl_is_written(tmp_path):
    """Turned into an error, the warning still finds data.pkl whole on disk."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Journal: data.pkl")
        with pytest.raises(UserWarning, match=r"records test_data_by_reference\.Sums by reference"):
            _fit(tmp_path, datamodule=Sums(n=1024))
    (payload,) = [p.read_bytes() for p in tmp_path.rglob("data.pkl")]
    assert [where for where, _ in references(payload)] == ["the data source"]
