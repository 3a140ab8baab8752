"""Tokenizers, text sources, the windowed token corpus, and deterministic per-peer data assignment.

A run's data is one flat token stream (documents joined by EOS) cut into windows of ``seq_len + 1``
tokens that overlap by one token, so every token after the first is a prediction target exactly once.
Which windows a peer trains on in a round is a pure function of (peer key, round, run seed, corpus):
validators recompute it to check a miner, and draw held-out windows that no peer is ever assigned.
The selection uses sha256 for keys and a fixed 64-bit mixing function for ranking, never Python's
``hash()`` (salted per process) nor a library RNG stream (not promised stable across versions), so
two machines with different Python/numpy versions agree.

Failure behaviour: a missing optional package (``pyarrow`` for parquet, ``datasets`` for Hugging Face
streaming, ``transformers`` tokenizers) raises ``ImportError`` saying what to install; a source that
matches no file raises ``FileNotFoundError``; a jsonl record that is not UTF-8 JSON or lacks the text
column raises ``ValueError`` naming the file and line; a tokenizer name that cannot be loaded raises
``ValueError`` naming it; a corrupt corpus cache is rebuilt. Hugging Face streaming is not exercised by
the offline tests.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import random
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file as save_numpy_file

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ tokenizers


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0–255 plus EOS = 256: works everywhere, downloads nothing."""

    name = "bytes"
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A named ``transformers`` tokenizer behind the same small interface as ``ByteTokenizer``."""

    def __init__(self, name: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a hard requirement of the package
            raise ImportError(f"tokenizer {name!r} needs the 'transformers' package") from e
        self.name = name
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name)
        except OSError as e:  # unknown name, no such path, offline without a cached copy: transformers says OSError
            raise ValueError(f"tokenizer {name!r} could not be loaded: {' '.join(str(e).split())}") from None
        self._tokenizer.model_max_length = 1 << 60  # we cut windows ourselves; silence the length warning
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no EOS token to separate documents")
        self.eos_token_id = int(self._tokenizer.eos_token_id)
        self.vocab_size = len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(name: str) -> Tokenizer:
    """``"bytes"`` → ``ByteTokenizer``; anything else is a Hugging Face tokenizer name (loaded lazily)."""
    return ByteTokenizer() if name == "bytes" else HuggingFaceTokenizer(name)


# --------------------------------------------------------------------------------------------------- sources

BUILTIN_SOURCE = "builtin"
STDLIB_SOURCE = "stdlib"
HF_PREFIX = "hf:"


def names_files(source: str) -> bool:
    """Whether ``source`` is paths/globs of files (not ``builtin``, ``stdlib`` or an ``hf:`` dataset)."""
    return source not in (BUILTIN_SOURCE, STDLIB_SOURCE) and not source.startswith(HF_PREFIX)


def iter_documents(source: str, *, text_column: str = "text") -> Iterator[str]:
    """Documents from a source string.

    ``"builtin"``: ``builtin_corpus()``; ``"stdlib"``: ``stdlib_corpus()``; ``"hf:NAME"``, ``"hf:NAME:CONFIG"``:
    a Hugging Face dataset, streamed (train split); anything else: comma-separated paths or globs of .txt (one
    document per file), .jsonl (one per line, ``text_column``) or .parquet (one per row, ``text_column``) files.
    """
    if source == BUILTIN_SOURCE:
        return iter(builtin_corpus())
    if source == STDLIB_SOURCE:
        return iter(stdlib_corpus())
    if source.startswith(HF_PREFIX):
        name, _, config = source[len(HF_PREFIX) :].partition(":")
        return iter_hf_documents(name, config or None, text_column=text_column)
    return iter_file_documents(source.split(","), text_column=text_column)


def resolve_files(patterns: Sequence[str]) -> list[Path]:
    """Each pattern is a path or a glob (``**`` allowed); results sorted so every peer reads the same order."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"data source {pattern!r} matches no file")
        files.extend(Path(m) for m in matches)
    return files


def iter_file_documents(patterns: Sequence[str], *, text_column: str = "text") -> Iterator[str]:
    for path in resolve_files(patterns):
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path, text_column)
        elif suffix == ".parquet":
            yield from _iter_parquet(path, text_column)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def _iter_jsonl(path: Path, text_column: str) -> Iterator[str]:
    line_no = 0
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get(text_column), str):
                    raise ValueError(f"{path}:{line_no}: no string field {text_column!r}")
                yield record[text_column]
    except json.JSONDecodeError as e:  # these messages name neither the file nor the line
        raise ValueError(f"{path}:{line_no}: not a JSON record: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (after line {line_no}): {e}") from None


def _iter_parquet(path: Path, text_column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs the 'pyarrow' package: pip install pyarrow") from e
    parquet = pq.ParquetFile(path)
    if text_column not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_column!r} (columns: {parquet.schema_arrow.names})")
    for batch in parquet.iter_batches(columns=[text_column]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def iter_hf_documents(
    name: str, config: str | None = None, *, split: str = "train", text_column: str = "text"
) -> Iterator[str]:
    """A Hugging Face dataset in streaming mode (nothing downloaded up front). Needs network access."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"Hugging Face dataset {name!r} needs the 'datasets' package: pip install datasets") from e
    for record in datasets.load_dataset(name, config, split=split, streaming=True):
        text = record.get(text_column)
        if isinstance(text, str):
            yield text


# ---------------------------------------------------------------------------------------------------- corpus


class TokenCorpus:
    """One flat token stream cut into windows of ``seq_len + 1`` tokens (stride ``seq_len``).

    Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: inputs are its first ``seq_len``
    tokens, labels its last ``seq_len`` (already shifted: the model's loss must not shift again).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, tokenizer_name: str) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.ndim != 1 or tokens.size < seq_len + 1:
            raise ValueError(f"corpus of {tokens.size} tokens is too small for one window of {seq_len + 1} tokens")
        self.tokens = tokens
        self.seq_len = seq_len
        self.tokenizer_name = tokenizer_name
        self.num_windows = (tokens.size - 1) // seq_len
        digest = hashlib.sha256(f"corpus-v1|{tokenizer_name}|{seq_len}|".encode())
        digest.update(tokens.astype("<i4", copy=False).tobytes())
        self.fingerprint = digest.hexdigest()

    @classmethod
    def from_documents(
        cls, documents: Iterable[str], tokenizer: Tokenizer, seq_len: int, *, max_tokens: int | None = None
    ) -> TokenCorpus:
        """Tokenizes documents, each followed by EOS, stopping once ``max_tokens`` tokens are collected."""
        pieces: list[np.ndarray] = []
        total = 0
        for text in documents:
            ids = np.asarray(tokenizer.encode(text) + [tokenizer.eos_token_id], dtype=np.int32)
            pieces.append(ids)
            total += ids.size
            if max_tokens is not None and total >= max_tokens:
                break
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        if max_tokens is not None:
            tokens = tokens[:max_tokens]
        return cls(tokens, seq_len, tokenizer.name)

    def window(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range [0, {self.num_windows})")
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batches(self, windows: Sequence[int], batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, labels)`` int64 tensors of shape ``[b, seq_len]``, in the order of ``windows``.

        The last batch is smaller when ``len(windows)`` is not a multiple of ``batch_size``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        for start in range(0, len(windows), batch_size):
            stacked = torch.stack([self.window(i) for i in windows[start : start + batch_size]])
            yield stacked[:, :-1], stacked[:, 1:]

    def save(self, path: str | Path) -> None:
        """Tokens as safetensors (no pickle), written to a temporary name first and renamed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_numpy_file({"tokens": self.tokens}, str(tmp), metadata={"tokenizer": self.tokenizer_name})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, seq_len: int) -> TokenCorpus:
        with safe_open(str(path), framework="numpy") as f:
            tokenizer_name = (f.metadata() or {}).get("tokenizer")
            if tokenizer_name is None:
                raise ValueError(f"{path}: no tokenizer recorded")
            return cls(f.get_tensor("tokens"), seq_len, tokenizer_name)


def build_corpus(
    source: str,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    text_column: str = "text",
    max_tokens: int | None = None,
    cache_dir: str | Path | None = None,
) -> TokenCorpus:
    """The corpus of a source string (see ``iter_documents``), reusing a token cache when one matches.

    The cache key covers the source string, each file's size and mtime, the tokenizer, the text column
    and ``max_tokens``; it cannot see a remote (``hf:``) dataset change, which the corpus fingerprint
    then reveals as a disagreement between peers.
    """
    cache_path = None
    if cache_dir is not None:
        key = _source_key(source, tokenizer.name, text_column, max_tokens)
        cache_path = Path(cache_dir) / f"tokens-{key}.safetensors"
        if cache_path.exists():
            try:
                return TokenCorpus.load(cache_path, seq_len)
            except (OSError, ValueError, KeyError, SafetensorError) as e:
                logger.warning("ignoring unreadable corpus cache %s: %s", cache_path, e)
    documents = iter_documents(source, text_column=text_column)
    corpus = TokenCorpus.from_documents(documents, tokenizer, seq_len, max_tokens=max_tokens)
    if cache_path is not None:
        corpus.save(cache_path)
    return corpus


@dataclass(frozen=True)
class DataConfig:
    """Where a run's text comes from and how it becomes tokens (every peer of a run must agree)."""

    source: str = BUILTIN_SOURCE  # see iter_documents
    text_column: str = "text"
    max_tokens: int | None = None
    tokenizer: str = "bytes"

    def load(self, seq_len: int, cache_dir: str | Path | None = None) -> tuple[Tokenizer, TokenCorpus]:
        """The tokenizer and the corpus, from the token cache in ``cache_dir`` when it matches."""
        tokenizer = load_tokenizer(self.tokenizer)
        corpus = build_corpus(self.source, tokenizer, seq_len, text_column=self.text_column,
                              max_tokens=self.max_tokens, cache_dir=cache_dir)
        return tokenizer, corpus


def _source_key(source: str, tokenizer_name: str, text_column: str, max_tokens: int | None) -> str:
    parts = [source, tokenizer_name, text_column, str(max_tokens)]
    if source == STDLIB_SOURCE:
        parts.append(sys.version)  # its text changes with the Python release
    elif names_files(source):
        for path in resolve_files(source.split(",")):
            stat = path.stat()
            parts.append(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------------------ builtin corpus


@lru_cache(maxsize=1)
def builtin_corpus() -> tuple[str, ...]:
    """About 440 KB of generated English-like documents, byte-identical on every machine.

    A fresh clone with no data can still train: the text has structure a small model can learn (fixed
    animal traits, arithmetic facts, counting, templated stories). It is generated from a fixed seed with
    ``random.Random.random()``, the one part of ``random`` whose sequence Python promises not to change.
    """
    rng = random.Random(20231115)

    def pick(options: Sequence[str]) -> str:
        return options[int(rng.random() * len(options))]

    numbers = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen \
sixteen seventeen eighteen nineteen twenty".split()
    animals = {
        "cat": ("cats", "grey", "meows", "fish"),
        "dog": ("dogs", "brown", "barks", "bones"),
        "cow": ("cows", "black and white", "moos", "grass"),
        "duck": ("ducks", "yellow", "quacks", "bread"),
        "horse": ("horses", "chestnut", "neighs", "hay"),
        "owl": ("owls", "speckled", "hoots", "mice"),
        "frog": ("frogs", "green", "croaks", "flies"),
        "sheep": ("sheep", "white", "bleats", "clover"),
    }
    names = "Ada Ben Clara David Elena Farid Grace Hugo Ines Jonas Kira Liam Maya Noah Olga Pavel".split()
    places = "the market|the river|the old mill|the forest|the harbour|the library|the hill|the garden".split("|")
    moods = "happy tired curious brave quiet cheerful sleepy proud".split()
    times = "In the morning|At noon|In the evening|Late at night|On Sunday|After the rain".split("|")

    def arithmetic() -> str:
        a, b = int(rng.random() * 11), int(rng.random() * 11)
        if rng.random() < 0.5:
            return f"{numbers[a].capitalize()} plus {numbers[b]} is {numbers[a + b]}."
        a, b = max(a, b), min(a, b)
        return f"{numbers[a].capitalize()} minus {numbers[b]} is {numbers[a - b]}."

    def counting() -> str:
        start = int(rng.random() * 12)
        length = 3 + int(rng.random() * 6)
        return ", ".join(numbers[start : start + length]).capitalize() + "."

    def story() -> str:
        name, animal, place = pick(names), pick(list(animals)), pick(places)
        plural, color, sound, food = animals[animal]
        friend = pick([n for n in names if n != name])
        sentences = [
            f"{pick(times)}, {name} walked to {place}.",
            f"There {name} met a {color} {animal}.",
            f"The {animal} {sound} and eats {food}.",
            f"{name} felt {pick(moods)} and told {friend} about the {animal}.",
        ]
        if rng.random() < 0.6:
            count = 2 + int(rng.random() * 8)
            sentences.append(f"Later {friend} saw {numbers[count]} {plural} near {pick(places)}.")
        sentences.append(f"{arithmetic()} {name} wrote that down before going home.")
        return " ".join(sentences)

    def facts() -> str:
        animal = pick(list(animals))
        _, color, sound, food = animals[animal]
        subject = f"{'An' if animal[0] in 'aeiou' else 'A'} {animal}"
        return f"{subject} is {color}. {subject} {sound}. {subject} eats {food}."

    generators = (story, story, story, arithmetic, counting, facts)
    documents = []
    for _ in range(520):
        paragraphs = [" ".join(pick(generators)() for _ in range(2 + int(rng.random() * 3))) for _ in range(2)]
        documents.append("\n".join(paragraphs) + "\n")
    return tuple(documents)


@lru_cache(maxsize=1)
def stdlib_corpus() -> tuple[str, ...]:
    """Real English prose that every Python install carries: ~1.3 MB on CPython 3.11, no download, no file.

    The generated built-in corpus is too regular to show memorization (a model that overfits one batch of it still
    helps every other batch), so whatever needs natural text without a data file uses this: the interactive help's
    documentation topics (``pydoc_data.topics``, ~465 KB), then the docstrings of the standard library's top-level
    modules, read with ``ast`` (nothing is imported or run), in sorted order. The text differs between Python
    releases, and so does the corpus fingerprint: peers on different Pythons fail fast with ``RunMismatchError``.
    Meant for tests and local runs; a real run names its data.
    """
    import ast
    from pydoc_data.topics import topics

    documents = [topics[name] for name in sorted(topics)]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a file this Python cannot parse carries no prose
            continue
        docstrings = [ast.get_docstring(node) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docstrings if d)
        if text:
            documents.append(text)
    return tuple(documents)


# ------------------------------------------------------------------------------------------ data assignment

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _key64(*parts: object) -> np.uint64:
    """A 64-bit key from sha256 over the parts (unambiguous: each part is length-prefixed)."""
    digest = hashlib.sha256()
    for part in parts:
        data = str(part).encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    return np.uint64(int.from_bytes(digest.digest()[:8], "big"))


def _rank(indices: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 of ``indices*golden + key``: a bijection of uint64, so ranks never tie."""
    z = indices.astype(np.uint64) * _GOLDEN + key
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _lowest(indices: np.ndarray, key: np.uint64, count: int) -> np.ndarray:
    """The ``count`` indices with the lowest rank under ``key``, in rank order."""
    ranks = _rank(indices, key)
    if count < indices.size:
        chosen = np.argpartition(ranks, count - 1)[:count]
    else:
        chosen = np.arange(indices.size)
    return indices[chosen[np.argsort(ranks[chosen])]]


class DataAssignment:
    """Which windows a peer trains on in a round, and which windows are held out for validators.

    Held-out windows are the ``ceil(heldout_fraction * num_windows)`` windows ranked lowest by a key of
    (run seed, corpus); they are the same every round and never assigned. A peer's windows for a round
    are the training windows ranked lowest by a key of (run seed, corpus, peer key, round): distinct
    within a call and, across peers and rounds, independent draws.
    """

    def __init__(self, corpus_fingerprint: str, num_windows: int, run_seed: int, heldout_fraction: float = 0.05):
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        num_heldout = math.ceil(heldout_fraction * num_windows)
        if num_windows < 1 or num_heldout >= num_windows:
            raise ValueError(f"{num_windows} windows leave none to train on with heldout_fraction={heldout_fraction}")
        self.corpus_fingerprint = corpus_fingerprint
        self.num_windows = num_windows
        self.run_seed = run_seed
        self.heldout_fraction = heldout_fraction
        all_windows = np.arange(num_windows, dtype=np.uint64)
        heldout = _lowest(all_windows, self._key("heldout"), num_heldout)
        self._heldout_mask = np.zeros(num_windows, dtype=bool)
        self._heldout_mask[heldout.astype(np.int64)] = True
        self._heldout = np.sort(heldout)
        self._train = all_windows[~self._heldout_mask]

    def _key(self, *parts: object) -> np.uint64:
        return _key64("data-assignment-v1", self.run_seed, self.corpus_fingerprint, self.num_windows, *parts)

    @property
    def num_heldout(self) -> int:
        return int(self._heldout.size)

    @property
    def num_train(self) -> int:
        return int(self._train.size)

    def is_heldout(self, window: int) -> bool:
        return bool(self._heldout_mask[window])

    def assigned_windows(self, peer_key: str, round: int, count: int) -> list[int]:
        """``count`` distinct training windows for ``peer_key`` in ``round``, in the order to train on them."""
        return self._draw(self._train, self._key("assign", peer_key, round), count, "training")

    def heldout_windows(self, round: int, count: int, salt: str = "") -> list[int]:
        """``count`` distinct held-out windows for ``round``; a different ``salt`` gives another draw."""
        return self._draw(self._heldout, self._key("heldout-sample", round, salt), count, "held-out")

    @staticmethod
    def _draw(pool: np.ndarray, key: np.uint64, count: int, kind: str) -> list[int]:
        if count < 0 or count > pool.size:
            raise ValueError(f"cannot draw {count} {kind} windows: only {pool.size} exist")
        if count == 0:
            return []
        return [int(i) for i in _lowest(pool, key, count)]
