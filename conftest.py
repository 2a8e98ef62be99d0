import pytest


@pytest.fixture(autouse=True)
def _run_in_a_fresh_directory(tmp_path, monkeypatch):
    """Trainers write logs and checkpoints under the working directory by default (as
    Lightning's do): keep every test's out of the repository and out of each other's way."""
    monkeypatch.chdir(tmp_path)
