"""Corpus building: stable split by file, a manifest that pins every document, the shipped sample."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from infernix_jax.demo import HELDOUT_TEXT_PATH, MANIFEST_PATH, load_heldout_text
from infernix_jax.demo.corpus import (
    CorpusDocument,
    iter_documents,
    kjv_chapter_text,
    kjv_documents,
    parse_kjv_chapters,
    split_of,
    stdlib_documents,
    write_corpus,
)
from infernix_jax.demo.special_tokens import ENDOFTEXT

KJV_SAMPLE = """
Song of Solomon 1

  1 The song of songs, which is Solomon's.
  2 Let him kiss me with the kisses of his mouth: for thy love is better than wine.

Song of Solomon 2

  1 I am the rose of Sharon, and the lily of the valleys.

1 John 1

  1 That which was from the beginning, which we have heard,
"""


def tiny_documents(count: int = 60) -> list[CorpusDocument]:
    documents = [
        CorpusDocument(f"stdlib/pkg/module_{i:03d}.py", "stdlib", f"def f{i}(x):\n    return x + {i}\n")
        for i in range(count)
    ]
    documents += [
        CorpusDocument(f"kjv/01-genesis/{i:03d}.txt", "kjv", kjv_chapter_text("Genesis", i, [f"Verse {i}."]))
        for i in range(1, count + 1)
    ]
    return documents


def test_parse_kjv_chapters_reads_multiword_books_and_verses() -> None:
    chapters = parse_kjv_chapters(KJV_SAMPLE)
    assert [(book, chapter, len(verses)) for book, chapter, verses in chapters] == [
        ("Song of Solomon", 1, 2),
        ("Song of Solomon", 2, 1),
        ("1 John", 1, 1),
    ]
    assert chapters[0][2][1].startswith("Let him kiss me")
    assert (
        kjv_chapter_text(*chapters[1])
        == "Song of Solomon 2\n\nI am the rose of Sharon, and the lily of the valleys.\n"
    )


def test_parse_kjv_chapters_rejects_unexpected_lines() -> None:
    with pytest.raises(ValueError):
        parse_kjv_chapters("  1 a verse before any heading\n")


def test_split_depends_only_on_the_path_and_holds_out_about_two_percent() -> None:
    paths = [f"stdlib/some/module_{i}.py" for i in range(20_000)]
    splits = [split_of(p) for p in paths]
    assert splits == [split_of(p) for p in reversed(paths)][::-1]
    assert 0.015 < splits.count("heldout") / len(paths) < 0.025
    assert split_of("a.py", heldout_fraction=0.0) == "train"
    assert split_of("a.py", heldout_fraction=1.0) == "heldout"


def test_stdlib_documents_skip_tests_third_party_and_unusable_files(tmp_path: Path) -> None:
    files = {
        "b.py": "x = 1\n",
        "a/__init__.py": "from a.b import c\n",
        "a/empty/__init__.py": "\n",
        "a/tests/test_a.py": "assert True\n",
        "test/test_b.py": "assert True\n",
        "site-packages/pkg/m.py": "y = 2\n",
        "a/notes.txt": "not python\n",
        "decomposed.py": "s = 'e\u0301'\n",  # NFD: would not round-trip through the NFC normalizer
        "marker.py": "s = '<|im_end|>'\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    excluded: list[dict] = []
    documents = list(stdlib_documents(tmp_path, excluded))
    assert [d.path for d in documents] == ["stdlib/a/__init__.py", "stdlib/b.py"]
    assert {e["path"]: e["reason"] for e in excluded} == {
        "stdlib/a/empty/__init__.py": "empty",
        "stdlib/decomposed.py": "not NFC-normalized",
        "stdlib/latin1.py": "not UTF-8",
        "stdlib/marker.py": "contains a special token's text",
    }


def test_write_corpus_records_every_file_with_its_hash_and_split(tmp_path: Path) -> None:
    documents = tiny_documents()
    manifest = write_corpus(
        documents, tmp_path, heldout_fraction=0.1, sample_budget={"stdlib": 10**6, "kjv": 10**6}
    )
    assert manifest == json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8"))
    entries = {e["path"]: e for e in manifest["documents"]}
    assert sorted(entries) == sorted(d.path for d in documents)
    for document in documents:
        data = (tmp_path / "documents" / document.path).read_bytes()
        entry = entries[document.path]
        assert data == document.text.encode("utf-8")
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        assert entry["split"] == split_of(document.path, 0.1)
    heldout = [p for p, e in entries.items() if e["split"] == "heldout"]
    assert 0 < len(heldout) < len(documents) // 2
    assert manifest["totals"]["heldout"]["files"] == len(heldout)
    assert [entry["path"] for entry, _ in iter_documents(tmp_path, split="heldout")] == sorted(heldout)
    # with budgets that fit everything, the sample is every held-out document, in path order
    texts = {d.path: d.text for d in documents}
    assert manifest["heldout_sample"]["paths"] == sorted(heldout)
    assert (tmp_path / "heldout.txt").read_text(encoding="utf-8") == ENDOFTEXT.join(
        texts[p] for p in sorted(heldout)
    )


def test_heldout_sample_keeps_to_its_byte_budget(tmp_path: Path) -> None:
    manifest = write_corpus(
        tiny_documents(), tmp_path, heldout_fraction=0.5, sample_budget={"stdlib": 60, "kjv": 0}
    )
    sample = manifest["heldout_sample"]
    assert sample["paths"] and all(p.startswith("stdlib/") for p in sample["paths"])
    assert sum(len(t) for t in (tmp_path / "heldout.txt").read_text().split(ENDOFTEXT)) <= 60


def test_iter_documents_refuses_a_changed_file(tmp_path: Path) -> None:
    write_corpus(tiny_documents(3), tmp_path)
    (tmp_path / "documents" / "stdlib/pkg/module_000.py").write_text("changed\n")
    with pytest.raises(ValueError, match="sha256"):
        list(iter_documents(tmp_path))


def test_shipped_manifest_and_heldout_sample_agree() -> None:
    manifest = json.loads(MANIFEST_PATH.read_text(encoding="utf-8"))
    documents = manifest["documents"]
    assert len(documents) > 1000
    assert all(len(d["sha256"]) == 64 and d["bytes"] > 0 for d in documents)
    assert all(d["split"] == split_of(d["path"], manifest["heldout_fraction"]) for d in documents)
    assert manifest["sources"]["python_version"] and manifest["sources"]["debian_packages"]["bible-kjv-text"]
    sample = manifest["heldout_sample"]
    data = HELDOUT_TEXT_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == sample["sha256"] and len(data) == sample["bytes"]
    assert 150_000 <= len(data) <= 300_000
    split_by_path = {d["path"]: d["split"] for d in documents}
    assert all(split_by_path[p] == "heldout" for p in sample["paths"])
    assert {p.split("/")[0] for p in sample["paths"]} == {"stdlib", "kjv"}
    assert len(load_heldout_text().split(ENDOFTEXT)) == len(sample["paths"])


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_kjv_documents_are_the_1189_chapters_in_bible_order() -> None:
    documents = list(kjv_documents())
    assert len(documents) == 1189
    assert documents[0].path == "kjv/01-genesis/001.txt"
    assert documents[0].text.startswith(
        "Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
    )
    assert documents[-1].path == "kjv/66-revelation/022.txt"
