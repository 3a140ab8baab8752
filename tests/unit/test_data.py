"""Tokenizer, sources, the windowed corpus, its cache, the built-in corpus and deterministic assignment."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from template.training import data
from template.training.data import (
    ByteTokenizer,
    DataAssignment,
    TokenCorpus,
    build_corpus,
    builtin_corpus,
    iter_documents,
    load_tokenizer,
)

# ------------------------------------------------------------------------------------------------ tokenizer


def test_byte_tokenizer_round_trips_unicode_and_drops_eos() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eos_token_id == 256
    text = "Thou art — naïve! 日本語 🙂\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id] + tok.encode("x")) == text + "x"


# --------------------------------------------------------------------------------------------------- corpus


def test_corpus_joins_documents_with_eos_and_windows_overlap_by_one() -> None:
    tok = ByteTokenizer()
    corpus = TokenCorpus.from_documents(["ab", "cde"], tok, seq_len=2)
    assert corpus.tokens.tolist() == [97, 98, 256, 99, 100, 101, 256]
    assert corpus.num_windows == 3  # (7 - 1) // 2
    assert corpus.window(0).tolist() == [97, 98, 256]
    assert corpus.window(1).tolist() == [256, 99, 100]
    assert corpus.window(2).tolist() == [100, 101, 256]
    with pytest.raises(IndexError):
        corpus.window(3)


def test_batches_are_shifted_pairs_in_window_order_with_a_short_last_batch() -> None:
    corpus = TokenCorpus.from_documents(["abcdefghijklmnopqrstuvwxyz" * 4], ByteTokenizer(), seq_len=8)
    windows = [5, 0, 3, 7, 1]
    batches = list(corpus.batches(windows, batch_size=2))
    assert [tuple(x.shape) for x, _ in batches] == [(2, 8), (2, 8), (1, 8)]
    inputs = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    assert inputs.dtype == labels.dtype == torch.int64
    for row, w in enumerate(windows):
        full = corpus.window(w)
        assert torch.equal(inputs[row], full[:-1]) and torch.equal(labels[row], full[1:])


def test_fingerprint_depends_on_tokens_and_seq_len() -> None:
    tok = ByteTokenizer()
    base = TokenCorpus.from_documents(["hello world"], tok, 4)
    assert base.fingerprint == TokenCorpus.from_documents(["hello world"], tok, 4).fingerprint
    assert base.fingerprint != TokenCorpus.from_documents(["hello worle"], tok, 4).fingerprint
    assert base.fingerprint != TokenCorpus.from_documents(["hello world"], tok, 5).fingerprint


def test_max_tokens_truncates_and_too_small_corpus_is_refused() -> None:
    corpus = TokenCorpus.from_documents(iter(["a" * 100, "b" * 100]), ByteTokenizer(), 8, max_tokens=50)
    assert corpus.tokens.size == 50
    with pytest.raises(ValueError, match="too small"):
        TokenCorpus.from_documents(["abc"], ByteTokenizer(), seq_len=8)


# -------------------------------------------------------------------------------------------------- sources


def test_text_jsonl_and_glob_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second file")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "row one"}) + "\n\n" + json.dumps({"text": "row two"}) + "\n")
    docs = list(iter_documents(f"{tmp_path}/**/*.txt,{tmp_path / 'c.jsonl'}"))
    assert docs == ["first file", "second file", "row one", "row two"]


def test_jsonl_without_the_text_column_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no string field 'text'"):
        list(iter_documents(str(path)))


def test_source_matching_nothing_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(iter_documents(str(tmp_path / "*.txt")))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` fail whether or not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        list(iter_documents(str(path)))


def test_hf_source_without_datasets_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        next(iter_documents("hf:roneneldan/TinyStories"))


def test_corpus_cache_is_reused_and_a_corrupt_one_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "text.txt"
    source.write_text("to be or not to be " * 50)
    cache = tmp_path / "cache"
    first = build_corpus(str(source), ByteTokenizer(), 16, cache_dir=cache)
    (cache_file,) = cache.iterdir()

    def no_tokenizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache should have been used")

    with monkeypatch.context() as patch:
        patch.setattr(data, "iter_documents", no_tokenizing)
        cached = build_corpus(str(source), ByteTokenizer(), 16, cache_dir=cache)
    assert cached.fingerprint == first.fingerprint and np.array_equal(cached.tokens, first.tokens)
    assert cached.tokenizer_name == "bytes" and cached.seq_len == 16

    cache_file.write_bytes(b"garbage")
    rebuilt = build_corpus(str(source), ByteTokenizer(), 16, cache_dir=cache)
    assert rebuilt.fingerprint == first.fingerprint

    source.write_text("a different text " * 50)  # a changed file gets a new cache entry
    changed = build_corpus(str(source), ByteTokenizer(), 16, cache_dir=cache)
    assert changed.fingerprint != first.fingerprint


def test_builtin_corpus_is_several_hundred_kb_and_deterministic() -> None:
    docs = builtin_corpus()
    size = sum(len(d.encode()) for d in docs)
    assert 300_000 <= size <= 700_000
    builtin_corpus.cache_clear()
    assert builtin_corpus() == docs
    assert list(iter_documents("builtin")) == list(docs)
    assert len(set(docs)) == len(docs)


# ------------------------------------------------------------------------------------------------ assignment


@pytest.fixture(scope="module")
def assignment() -> DataAssignment:
    return DataAssignment("f" * 64, num_windows=2000, run_seed=42)


def test_assignment_is_deterministic_and_distinct_within_a_call(assignment: DataAssignment) -> None:
    again = DataAssignment("f" * 64, num_windows=2000, run_seed=42)
    first = assignment.assigned_windows("5Fpeer-a", round=3, count=64)
    assert first == again.assigned_windows("5Fpeer-a", round=3, count=64)
    assert len(set(first)) == 64 and all(0 <= w < 2000 for w in first)
    assert assignment.heldout_windows(3, 10) == again.heldout_windows(3, 10)


def test_assignment_differs_between_peers_rounds_seeds_and_corpora(assignment: DataAssignment) -> None:
    base = assignment.assigned_windows("peer-a", 0, 64)
    assert base != assignment.assigned_windows("peer-b", 0, 64)
    assert base != assignment.assigned_windows("peer-a", 1, 64)
    assert base != DataAssignment("f" * 64, 2000, run_seed=43).assigned_windows("peer-a", 0, 64)
    assert base != DataAssignment("e" * 64, 2000, run_seed=42).assigned_windows("peer-a", 0, 64)
    # Different peers overlap only as much as independent draws do (64*64/1900 ≈ 2 expected).
    assert len(set(base) & set(assignment.assigned_windows("peer-b", 0, 64))) < 12


def test_heldout_windows_are_a_fixed_fraction_never_assigned(assignment: DataAssignment) -> None:
    assert assignment.num_heldout == math.ceil(0.05 * 2000)
    heldout = {w for w in range(2000) if assignment.is_heldout(w)}
    assert len(heldout) == assignment.num_heldout
    everything = assignment.assigned_windows("peer-a", 0, assignment.num_train)
    assert set(everything) == set(range(2000)) - heldout
    drawn = assignment.heldout_windows(0, 20)
    assert set(drawn) <= heldout and len(set(drawn)) == 20
    assert drawn != assignment.heldout_windows(0, 20, salt="validator-2")
    assert drawn != assignment.heldout_windows(1, 20)


@settings(max_examples=40, deadline=None)
@given(peer=st.text(min_size=1, max_size=48), round=st.integers(0, 10**9), count=st.integers(0, 200))
def test_no_draw_ever_contains_a_heldout_window(peer: str, round: int, count: int) -> None:
    assignment = DataAssignment("ab" * 32, num_windows=500, run_seed=7, heldout_fraction=0.1)
    windows = assignment.assigned_windows(peer, round, count)
    assert len(windows) == len(set(windows)) == count
    assert not any(assignment.is_heldout(w) for w in windows)


def test_impossible_draws_and_fractions_are_refused(assignment: DataAssignment) -> None:
    with pytest.raises(ValueError, match="only"):
        assignment.assigned_windows("peer", 0, assignment.num_train + 1)
    with pytest.raises(ValueError, match="only"):
        assignment.heldout_windows(0, assignment.num_heldout + 1)
    with pytest.raises(ValueError, match="heldout_fraction"):
        DataAssignment("f" * 64, 100, 0, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="none to train"):
        DataAssignment("f" * 64, 1, 0, heldout_fraction=0.5)
    assert assignment.assigned_windows("peer", 0, 0) == []
