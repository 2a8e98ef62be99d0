"""A character-level Transformer trained on the Python standard library's own source.

    python examples/char_lm.py [--steps 400] [--batch 16] [--block 64] [--root runs/char_lm]
    python examples/char_lm.py --stop-at 150    # a Ctrl-C after step 150: saves it, stops
    python examples/char_lm.py --resume         # on from the newest in <root>/checkpoints
    python examples/char_lm.py --strategy ddp --devices 2 --batch 8   # 2 ranks, same global batch

The text is the running interpreter's standard library (its top-level ``.py`` files in sorted
order, up to ``--corpus-chars`` characters): nothing is downloaded, and the same Python gives
the same corpus, vocabulary and split on every machine. The last tenth is held out for
validation. The model is a small decoder-only Transformer (token and learned position
embeddings, pre-norm causal self-attention blocks, output weights tied to the token
embedding), trained under ``bf16-mixed`` with AdamW on a warmup-cosine schedule whose length is
the run's (``total_steps="auto"``), gradients clipped to norm 1, a checkpoint every
``--ckpt-every`` steps and ``last``. The validation loss is reported in bits per character
(a model that knows nothing scores log2(vocabulary size)); at the end the model writes
``--sample-chars`` characters after ``--prompt``, drawn with a generator seeded from
``(--seed, step)``, so the same checkpoint writes the same text.

On a CPU without bfloat16 instructions (AVX-512 BF16, AMX) torch emulates the bf16 matmuls,
about 19 times slower than float32's on the 2-core AVX2 machine this was measured on: there
the defaults train in 3.8 minutes, and ``--precision 32-true`` in 0.6, to the same 3.34
bits per character (6.49 untrained).

Under ``--strategy ddp`` the Trainer runs this script once more per extra rank (the run is
under ``if __name__ == "__main__"`` for that reason); ``--batch`` is per rank, and rank 0
prints (every rank draws the same sample).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import engine as eg
from engine import optim, rng
from engine.listeners import ModelCheckpoint

UNKNOWN = "\ufffd"  # what a non-ASCII character (or an undecodable byte) becomes


@functools.lru_cache(maxsize=4)
def corpus(max_chars: int) -> str:
    """The first ``max_chars`` characters of the standard library's top-level ``.py`` files,
    concatenated in sorted order; characters outside ASCII become ``UNKNOWN``, so the
    vocabulary stays small and the same for every Python of this version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.isascii():
            text = "".join(c if c.isascii() else UNKNOWN for c in text)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    if len(text) < max_chars:
        raise ValueError(
            f"--corpus-chars {max_chars}: the standard library at {root} has only "
            f"{len(text):,} characters in top-level .py files; ask for fewer"
        )
    return text


class Vocabulary:
    """The corpus's characters, sorted; ``encode`` / ``decode`` map text to ids and back."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        if len(self.chars) > 256:
            raise ValueError(f"{len(self.chars)} distinct characters: more than a byte holds")
        self._to_id = {ord(c): chr(i) for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        missing = sorted(set(text) - set(self.chars))
        if missing:
            raise ValueError(
                f"characters {missing!r} are not in the vocabulary of {len(self)} characters "
                "taken from the corpus; use only characters that occur in Python source"
            )
        as_bytes = text.translate(self._to_id).encode("latin-1")  # one byte per id
        return torch.frombuffer(bytearray(as_bytes), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class Windows(Dataset):
    """Map-style: window ``i`` is ``(ids[i*block : (i+1)*block], the same shifted by one)``,
    so the Trainer's seeded order and mid-epoch resume apply."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        if len(ids) <= block:
            raise ValueError(f"--block {block}: the split has only {len(ids)} characters")
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, time, head width)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharTransformer(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, a final norm, and logits through
    the token embedding's weights (tied)."""

    def __init__(
        self, vocab: int, block: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"--width {width} must be a multiple of --heads {heads}")
        self.block = block
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.norm(self.blocks(x)))


LN2 = math.log(2.0)


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return loss, {"bpc": loss.detach() / LN2}


def eval_fn(model, batch):
    loss, metrics = loss_fn(model, batch)
    return {"loss": loss, **metrics}


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: torch.Tensor,
    n: int,
    *,
    generator: torch.Generator,
    temperature: float = 0.8,
    top_k: int | None = 20,
) -> torch.Tensor:
    """``n`` ids drawn one at a time after ``prompt`` (a 1-D tensor of ids), each from the
    softmax of the last position's logits over ``temperature``, restricted to the ``top_k``
    likeliest; the randomness is ``generator``'s alone."""
    model.eval()
    ids = prompt[None]
    for _ in range(n):
        logits = model(ids[:, -model.block :])[:, -1].float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # fmt: off
    p.add_argument("--steps", "--max-steps", dest="steps", type=int, default=400,
                   help="optimizer steps of the run (the schedule's length)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="send this process SIGINT after this many steps, as a Ctrl-C would")
    p.add_argument("--batch", type=int, default=16, help="windows per step, per rank")
    p.add_argument("--block", type=int, default=64, help="characters per window")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/10)")
    p.add_argument("--corpus-chars", type=int, default=1_500_000)
    p.add_argument("--val-chars", type=int, default=40_000,
                   help="validate on this many held-out characters (the first of the split)")
    p.add_argument("--val-every", type=int, default=100, help="validate every n steps")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every n steps")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--sample-chars", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/char_lm", help="logs and checkpoints")
    p.add_argument("--resume", action="store_true", help="resume from <root>/checkpoints/last")
    p.add_argument("--strategy", default="auto", choices=("auto", "ddp"))
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--results", default=None, help="also write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no model summary")
    # fmt: on
    return p.parse_args(argv)


class Interrupt(eg.Listener):
    """After ``step`` optimizer steps, send this process SIGINT, as a Ctrl-C would: the Trainer
    finishes the batch, saves ``checkpoints/interrupted-step=N`` and raises
    ``KeyboardInterrupt``; ``--resume`` goes on from there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, rec: eg.EventRecord) -> None:
        if rec.run.global_step == self.step and rec.run.is_global_zero:
            os.kill(os.getpid(), signal.SIGINT)


def load(args: argparse.Namespace) -> tuple[Vocabulary, Windows, Dataset]:
    """The vocabulary, the training windows (the first nine tenths of the corpus) and the
    validation windows (the first ``--val-chars`` characters of the last tenth)."""
    vocab = Vocabulary(corpus(args.corpus_chars))
    ids = vocab.encode(corpus(args.corpus_chars))
    split = len(ids) * 9 // 10
    val = Windows(ids[split:], args.block)
    kept = range(min(len(val), max(1, args.val_chars // args.block)))
    return vocab, Windows(ids[:split], args.block), torch.utils.data.Subset(val, kept)


def make_task(args: argparse.Namespace, vocab: Vocabulary) -> eg.Task:
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    # "auto": the Trainer gives the schedule the run's length (max_steps here)
    schedule = optim.warmup_cosine(
        args.lr, warmup_steps=warmup, end=args.lr / 10, total_steps="auto"
    )
    tx = optim.adamw(schedule, betas=(0.9, 0.95), weight_decay=0.1, mask=optim.decay_mask)
    return eg.Task(
        loss_fn, tx, eval_fn=eval_fn, lr=schedule, prog_bar=["bpc"],
        hparams={**sizes(args), "lr": args.lr, "batch": args.batch, "vocab": len(vocab)},
    )  # fmt: skip


def sizes(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("block", "width", "layers", "heads", "dropout")}


def make_trainer(args: argparse.Namespace, checkpoints: ModelCheckpoint) -> eg.Trainer:
    return eg.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,  # val_check_interval counts steps across epochs
        num_sanity_val_steps=0,
        callbacks=[checkpoints] + ([Interrupt(args.stop_at)] if args.stop_at else []),
        default_root_dir=args.root,
        log_every_n_steps=10,
        enable_progress_bar=not args.quiet,
        enable_model_summary=not args.quiet,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    vocab, train, val = load(args)
    prompt = vocab.encode(args.prompt)  # an unknown character fails now, not after training
    # the order of epoch e is a function of (seed, e); under ddp each rank reads its share of it
    train_loader = DataLoader(
        train, batch_size=args.batch, sampler=eg.data.ShuffleSampler(train, seed=args.seed)
    )
    val_loader = DataLoader(val, batch_size=args.batch)
    task = make_task(args, vocab)
    torch.manual_seed(args.seed)  # the script owns its process: seed the initial weights
    state = task.init(CharTransformer(len(vocab), **sizes(args)), seed=args.seed)
    checkpoints = ModelCheckpoint(
        dirpath=Path(args.root) / "checkpoints", every_n_train_steps=args.ckpt_every, save_last=True
    )
    trainer = make_trainer(args, checkpoints)

    before = trainer.validate(task, state, val_loader, verbose=False)[0]["val/bpc"]
    start = time.perf_counter()
    state = trainer.fit(
        task, state, train_loader, val_loader, ckpt_path="last" if args.resume else None
    )
    seconds = time.perf_counter() - start
    resumed_from = trainer.ckpt_path  # None unless --resume found a checkpoint
    after = trainer.validate(task, state, val_loader, verbose=False)[0]["val/bpc"]

    # sampling, on the CPU in float32, from a generator of its own: (seed, step) fix the text
    model = state.load_into(CharTransformer(len(vocab), **sizes(args)))
    g = torch.Generator().manual_seed(rng.derive_seed(args.seed, state.step, stream=rng.PREDICT))
    drawn = sample(
        model, prompt, args.sample_chars, generator=g, temperature=args.temperature,
        top_k=args.top_k,
    )  # fmt: skip
    results = {
        "vocab": len(vocab),
        "uniform_bpc": math.log2(len(vocab)),
        "initial_bpc": before,
        "final_bpc": after,
        "step": state.step,
        "resumed_from": resumed_from,
        "seconds": seconds,
        "params": state.num_params(),
        "fingerprint": state.fingerprint(),
        "sample": vocab.decode(drawn),
        "world_size": trainer.world_size,
    }
    if trainer.is_global_zero:
        print(
            f"char_lm: {args.corpus_chars:,} characters of {sysconfig.get_paths()['stdlib']} "
            f"({len(vocab)} distinct), {len(train):,} training windows of {args.block}, "
            f"{state.num_params():,} parameters, {trainer.world_size} process(es)"
        )
        print(
            f"{state.step} steps"
            + (f" (resumed from {resumed_from})" if resumed_from else "")
            + f" in {seconds / 60:.1f} min; validation bits/char {before:.3f} before training "
            f"(uniform: {results['uniform_bpc']:.3f}), {after:.3f} after; checkpoints in "
            f"{checkpoints.dirpath}"
        )
        print(f"sample after {args.prompt!r}:\n{args.prompt}{results['sample']}")
        if args.results:
            Path(args.results).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # the Trainer has said on stderr where it saved the interrupted run
