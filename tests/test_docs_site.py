"""The docs site: it builds offline with warnings as errors, every page is in its navigation,
every code block of every page runs, and the Lightning migration table covers every Trainer
flag, Callback hook and LightningModule hook of the installed Lightning.

``>>>`` blocks run as doctests (``--doctest-glob=*.md``). The other Python blocks run here:
each page's in order in one namespace, as a reader's session would, in a fresh directory; a
block marked ``<!-- docs-test: script -->`` runs as a file of its own in a fresh process, and
``<!-- docs-test: torchrun -->`` under torchrun on 2 CPU ranks. Shell blocks name ``engine``
subcommands and flags that must exist; the CLI page's YAML config runs as written.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import textwrap
from pathlib import Path

import _procs
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_ddp_trainer import _env, _ok, _torchrun

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_FENCE = re.compile(
    r"(?:<!-- docs-test: (?P<mode>\w+) -->\n)?(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<code>.*?)```",
    re.S,
)


def _blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """``(lang, code, mode)`` of each fenced block of ``page``, dedented."""
    out = []
    for m in _FENCE.finditer(page.read_text()):
        out.append((m["lang"], textwrap.dedent(m["code"]), m["mode"]))
    return out


def _python(page: Path) -> list[tuple[str, str | None]]:
    return [
        (code, mode) for lang, code, mode in _blocks(page) if lang == "python" and ">>>" not in code
    ]


def _session(page: Path) -> list[tuple[str, str | None]]:
    """The page's Python blocks in order, as a reader runs them: a ``>>>`` block as the
    source of its examples (their outputs are the doctest's to check), the others whole."""
    import doctest

    out: list[tuple[str, str | None]] = []
    for lang, code, mode in _blocks(page):
        if lang != "python":
            continue
        if ">>>" in code:
            examples = doctest.DocTestParser().get_examples(code)
            out.append(("\n".join(_guarded(e) for e in examples), "doctest"))
        else:
            out.append((code, mode))
    return out


def _guarded(example) -> str:
    """A doctest example's source; one whose expected output is an exception, wrapped so the
    session goes on past it (as the doctest does)."""
    if example.exc_msg is None:
        return example.source
    body = textwrap.indent(example.source, "    ")
    return f"try:\n{body}except Exception:\n    pass\n"


# What the pages' fragments assume their reader has defined (a page's text says so around them)
PRELUDES = {
    "checkpoints.md": """
import torch, torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset
import engine as eg
from engine import optim
my_dataset = TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
class MyBatchSampler(BatchSampler):
    def __init__(self, ds):
        super().__init__(SequentialSampler(ds), 8, False)
state = eg.TrainState.create(torch.nn.Linear(3, 1), optim.adamw(1e-3))
eg.checkpoint.save(state, "step=000120")
""",
    "cli.md": """
import os, sys, tempfile, textwrap
import torch.nn.functional as F
import engine as eg
from engine import optim
def loss_fn(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])
# the script block runs as `python train.py --config cfg.yaml ...` would: its arguments
_where = tempfile.mkdtemp()
sys.path.insert(0, _where)
sys.path.insert(0, os.path.join(os.path.dirname(eg.__file__), "..", "tests"))
import test_cli
with open(os.path.join(_where, "cliproj.py"), "w") as f:
    f.write(textwrap.dedent(test_cli._MODULE))
with open(os.path.join(_where, "cfg.yaml"), "w") as f:
    f.write(textwrap.dedent(test_cli._CONFIG))
sys.argv = ["train.py", "--config", os.path.join(_where, "cfg.yaml"), "--trainer.max_epochs=2",
            f"--trainer.default_root_dir={_where}",
            "--trainer.callbacks=engine.listeners.ModelCheckpoint",
            "--trainer.callbacks.monitor=val/loss"]
""",
    "finetuning.md": """
import torch.nn.functional as F
import engine as eg
def loss_fn(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])
""",
}


@pytest.mark.slow
def test_the_docs_site_builds_offline_with_warnings_as_errors(tmp_path):
    """``mkdocs build --strict``, with every proxy pointing nowhere: a plugin that fetched
    anything would fail the build. Every public name has its entry in the API reference."""
    env = {
        **_env(),
        "NO_MKDOCS_2_WARNING": "1",
        **{
            k: "http://127.0.0.1:9"
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
        },
    }
    site = tmp_path / "site"
    proc = _procs.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    import engine as eg

    reference = (site / "api" / "engine" / "index.html").read_text()
    missing = [
        n for n in eg.__all__ if not n.startswith("_") and f'id="engine.{n}"' not in reference
    ]
    missing = [n for n in missing if not inspect.ismodule(getattr(eg, n))]
    assert not missing, f"public names without an API reference entry: {missing}"
    for page in PAGES:
        assert (site / (page.stem if page.stem != "index" else "") / "index.html").is_file()


def test_every_page_is_in_the_navigation():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))

    def files(nav):
        for item in nav:
            for value in item.values() if isinstance(item, dict) else [item]:
                yield from files(value) if isinstance(value, list) else [value]

    listed = set(files(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == listed, (
        f"not in the nav: {sorted(pages - listed)}; missing: {sorted(listed - pages)}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _python(p)], ids=lambda p: p.name)
def test_every_python_block_of_a_page_runs(page, tmp_path):
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    out = io.StringIO()
    if page.name in PRELUDES:
        exec(compile(PRELUDES[page.name], f"prelude of {page.name}", "exec"), namespace)
    for number, (code, mode) in enumerate(_session(page), 1):
        where = f"{page.name}, python block {number}"
        if mode == "doctest":  # what the page's reader has defined by now; checked by doctest
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, where, "exec"), namespace)
            continue
        if mode is None:
            with contextlib.redirect_stdout(out):
                exec(compile(code, where, "exec"), namespace)
            continue
        script = tmp_path / f"block{number}.py"
        script.write_text(code)
        if mode == "torchrun":
            proc = _torchrun(script, {}, timeout=300, real=True)  # as the page says
        elif mode == "script":
            proc = _procs.run(
                [sys.executable, str(script)],
                env=_env(),
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
            )
        else:
            raise AssertionError(f"{where}: unknown docs-test mode {mode!r}")
        _ok(proc)
        out.write(proc.stdout)
    printed = out.getvalue()
    # what the blocks print where the page says what they print
    if page.name == "checkpoints.md":
        assert printed.splitlines()[0] == "True"  # meta.json's checksum, checked by hand
        import json

        meta = json.loads(Path("step=000120/meta.json").read_text())
        assert printed.splitlines()[1] in json.dumps(meta["files"])  # tensors.pt's, by hand
    if page.name == "averaging.md":
        assert printed.split()[-1] == "4"  # after the model summaries
    if page.name == "distributed.md":
        # torchrun starts its workers unbuffered (python -u): print's text and its newline are
        # two writes, so the ranks' lines may interleave at the newlines, never inside the text
        assert "24" in printed.split()  # the ddp_spawn caller's, alone
        assert "rank 0: step 4" in printed and "rank 1: step 4" in printed


def _engine_help(sub: str) -> str:
    proc = _procs.run(
        [sys.executable, "-m", "engine", sub, "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_engine_command_in_the_docs_exists_with_its_flags():
    """Shell blocks: each ``engine SUB ...`` line names a subcommand and flags it has (the
    runs themselves are in tests/test_cli*.py); other lines launch processes on machines
    the tests do not have (torchrun across nodes, srun) or install."""
    helps: dict[str, str] = {}
    checked = 0
    for page in [*PAGES, ROOT / "README.md"]:
        for lang, code, _ in _blocks(page):
            if lang not in ("bash", "sh", "console"):
                continue
            for line in code.splitlines():
                words = line.split("#")[0].split()
                if words[:1] == ["python"] and words[1:3] == ["-m", "engine"]:
                    words = ["engine", *words[3:]]
                if words[:1] != ["engine"] or len(words) < 2:
                    continue
                sub = words[1]
                helps.setdefault(sub, _engine_help(sub))
                for flag in (
                    w.strip("[]").split("=")[0] for w in words if w.strip("[").startswith("--")
                ):
                    assert flag in helps[sub], f"{page.name}: `engine {sub}` has no {flag}: {line}"
                checked += 1
    assert checked >= 3


def test_the_cli_pages_config_runs_as_written(tmp_path):
    """cli.md's YAML, with the package it names (its task function is the page's own block),
    runs a fit for one epoch (the only override)."""
    import yaml

    ((_lang, config, _),) = [b for b in _blocks(DOCS / "cli.md") if b[0] == "yaml"]
    task_code = next(code for code, _ in _python(DOCS / "cli.md"))
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(
        "import torch\n"
        "class MLP(torch.nn.Sequential):\n"
        "    def __init__(self, hidden: int = 32):\n"
        "        super().__init__(torch.nn.Linear(64, hidden), torch.nn.ReLU(),\n"
        "                         torch.nn.Linear(hidden, 10))\n"
    )
    (pkg / "tasks.py").write_text(PRELUDES["cli.md"] + task_code)
    (pkg / "data.py").write_text(
        textwrap.dedent(
            """
            import torch
            from sklearn.datasets import load_digits
            from torch.utils.data import DataLoader, TensorDataset
            class Digits:
                def __init__(self, batch_size: int = 32):
                    x, y = load_digits(return_X_y=True)
                    t = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y))
                    self.train, self.val = torch.utils.data.random_split(
                        t, [1500, 297], generator=torch.Generator().manual_seed(0))
                    self.batch_size = batch_size
                def train_dataloader(self):
                    return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)
                def val_dataloader(self):
                    return DataLoader(self.val, batch_size=256)
            """
        )
    )
    cfg = yaml.safe_load(config)
    assert cfg["model"]["class_path"] == "mypkg.models.MLP"
    (tmp_path / "cfg.yaml").write_text(config)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = _procs.run(
        [sys.executable, "-m", "engine", "fit", "--config", "cfg.yaml", "--trainer.max_epochs=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    _ok(proc)
    assert list((tmp_path / "runs" / "mlp").rglob("*.ckpt")) or list(
        (tmp_path / "runs" / "mlp").rglob("meta.json")
    ), "the fit saved no checkpoint"


def test_the_migration_table_covers_lightning_flags_and_hooks():
    """Lightning itself is the list: every ``Trainer.__init__`` flag, every ``Callback`` hook
    and every ``LightningModule`` hook of the installed version has its engine form named in
    docs/lightning.md."""
    import pytorch_lightning as pl
    from pytorch_lightning.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    text = (DOCS / "lightning.md").read_text()
    flags = [p for p in inspect.signature(pl.Trainer.__init__).parameters if p != "self"]
    assert not [f for f in flags if f"`{f}`" not in text], "Trainer flags not in lightning.md"

    def hooks(*classes):
        return sorted(
            {
                n
                for c in classes
                for n, _ in inspect.getmembers(c, inspect.isfunction)
                if not n.startswith("_")
            }
        )

    callback = hooks(pl.Callback)
    assert not [h for h in callback if f"`{h}`" not in text], "Callback hooks not in lightning.md"
    module = [
        *hooks(ModelHooks, DataHooks, CheckpointHooks),
        # LightningModule's own methods a port meets
        "training_step",
        "validation_step",
        "test_step",
        "predict_step",
        "forward",
        "configure_optimizers",
        "configure_callbacks",
        "configure_gradient_clipping",
        "clip_gradients",
        "backward",
        "manual_backward",
        "optimizer_step",
        "optimizer_zero_grad",
        "lr_scheduler_step",
        "toggle_optimizer",
        "untoggle_optimizer",
        "log",
        "log_dict",
        "save_hyperparameters",
        "freeze",
        "unfreeze",
        "all_gather",
        "to_onnx",
        "to_torchscript",
    ]
    missing = [h for h in module if f"`{h}`" not in text]
    assert not missing, f"LightningModule hooks not in lightning.md: {missing}"
