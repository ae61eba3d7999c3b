"""Build the demo model's training corpus from text every Debian machine has offline.

Two sources, both reproducible without a network:

* code: the running interpreter's standard library ``.py`` files (its ``stdlib`` directory, sorted,
  without ``test``/``tests``/``idle_test`` folders and without ``site-packages``);
* prose: the King James Bible from Debian's ``bible-kjv-text`` package (its text is stored in a
  compressed format, so it is read through the ``bible`` program of the ``bible-kjv`` package:
  ``apt-get install bible-kjv``), one document per chapter.

Documents are split into train and held-out *by file*: a document is held out when the first eight
bytes of ``sha256(path)`` read as a fraction fall below ``heldout_fraction``, so the split is stable
and does not depend on the order files are found in. A manifest records every document (path,
source, bytes, sha256, split), the Python version and the Debian package versions.

A held-out *sample* (a few hundred KB of code and prose) ships with the package as ``heldout.txt``
because the standard library differs across Python versions and perplexity tests must read exactly
the same text everywhere.

    python -m infernix_jax.demo.corpus --out build/demo/corpus [--update-package]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from infernix_jax.demo import HELDOUT_TEXT_PATH, MANIFEST_PATH
from infernix_jax.demo.special_tokens import ENDOFTEXT, contains_added_token

MANIFEST_FORMAT = 1
DEFAULT_HELDOUT_FRACTION = 0.02
# Folder names never taken from the stdlib directory: tests, and third-party packages that some
# installs (pyenv, Debian's dist-packages) keep under it.
EXCLUDED_STDLIB_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
KJV_DATA_FILE = Path("/usr/lib/bible.data")
KJV_FULL_RANGE = "Gen1:1-Rev22:21"
# Byte budgets of the shipped held-out sample, per source, so that it mixes code and prose.
HELDOUT_SAMPLE_BUDGET = {"stdlib": 180_000, "kjv": 80_000}


@dataclass(frozen=True)
class CorpusDocument:
    """One document of the corpus: its corpus-relative path, its source and its text."""

    path: str  # e.g. "stdlib/json/decoder.py" or "kjv/01-genesis/001.txt"
    source: str  # "stdlib" (code) or "kjv" (prose)
    text: str


@dataclass(frozen=True)
class ManifestEntry:
    """What the manifest records of one document."""

    path: str
    source: str
    bytes: int
    sha256: str
    split: str  # "train" or "heldout"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def heldout_score(path: str) -> float:
    """The path's position in [0, 1): the first eight bytes of its sha256 read as a fraction."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_of(path: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> str:
    """ "heldout" or "train" for a document path; depends on nothing but the path."""
    return "heldout" if heldout_score(path) < heldout_fraction else "train"


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(stdlib_dir: Path) -> list[Path]:
    """The stdlib's ``.py`` files, sorted by relative path, without tests or third-party folders."""
    found: list[Path] = []
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_STDLIB_DIRS)
        found.extend(Path(root) / name for name in files if name.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(stdlib_dir).as_posix())


def unusable_reason(text: str) -> str | None:
    """Why a text cannot be a document, or None.

    The tokenizer normalizes to NFC (as Qwen's does), so a non-NFC text would not round-trip; a
    text holding a special token's literal would tokenize as that marker; an empty file (many
    ``__init__.py``) holds nothing to learn.
    """
    if not text.strip():
        return "empty"
    if unicodedata.normalize("NFC", text) != text:
        return "not NFC-normalized"
    if contains_added_token(text):
        return "contains a special token's text"
    return None


def stdlib_documents(stdlib_dir: Path, excluded: list[dict]) -> Iterator[CorpusDocument]:
    """The stdlib's source files as documents; files that cannot be used go to ``excluded``."""
    for file in stdlib_source_files(stdlib_dir):
        path = "stdlib/" + file.relative_to(stdlib_dir).as_posix()
        try:
            text = file.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            excluded.append({"path": path, "reason": "not UTF-8"})
            continue
        reason = unusable_reason(text)
        if reason is not None:
            excluded.append({"path": path, "reason": reason})
            continue
        yield CorpusDocument(path=path, source="stdlib", text=text)


_KJV_HEADING = re.compile(r"^(\S.*) (\d+)$")
_KJV_VERSE = re.compile(r"^ +(\d+) (.*)$")


def parse_kjv_chapters(pretty_text: str) -> list[tuple[str, int, list[str]]]:
    """Parse ``bible -l N`` pretty output into (book, chapter, verses) in Bible order.

    The output is a heading line "Book C" (after a blank line), then one line per verse,
    "  V text"; the line width N must be large enough that no verse wraps.
    """
    chapters: list[tuple[str, int, list[str]]] = []
    for line in pretty_text.splitlines():
        if not line:
            continue
        verse = _KJV_VERSE.match(line)
        if verse is not None:
            if not chapters:
                raise ValueError(f"verse before any chapter heading: {line!r}")
            chapters[-1][2].append(verse.group(2))
            continue
        heading = _KJV_HEADING.match(line)
        if heading is None:
            raise ValueError(f"unexpected line in bible output: {line!r}")
        chapters.append((heading.group(1), int(heading.group(2)), []))
    return chapters


def kjv_chapter_text(book: str, chapter: int, verses: list[str]) -> str:
    """A chapter as plain prose: a "Book C" title, a blank line, then one verse per line."""
    return f"{book} {chapter}\n\n" + "\n".join(verses) + "\n"


def kjv_documents(bible_program: str = "bible") -> Iterator[CorpusDocument]:
    """The King James Bible, one document per chapter, read through Debian's ``bible`` program."""
    if shutil.which(bible_program) is None:
        raise FileNotFoundError(
            f"{bible_program!r} not found: install Debian's bible-kjv and bible-kjv-text packages "
            "(apt-get install bible-kjv)"
        )
    pretty = subprocess.run(
        [bible_program, "-l", "100000", KJV_FULL_RANGE], check=True, capture_output=True, text=True
    ).stdout
    book_numbers: dict[str, int] = {}
    for book, chapter, verses in parse_kjv_chapters(pretty):
        number = book_numbers.setdefault(book, len(book_numbers) + 1)
        slug = re.sub(r"[^a-z0-9]+", "-", book.lower()).strip("-")
        path = f"kjv/{number:02d}-{slug}/{chapter:03d}.txt"
        yield CorpusDocument(path=path, source="kjv", text=kjv_chapter_text(book, chapter, verses))


def debian_package_version(package: str) -> str | None:
    """The installed version of a Debian package, or None when dpkg does not know it."""
    try:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        return None
    return result.stdout.strip() or None


def manifest_entry(document: CorpusDocument, heldout_fraction: float) -> ManifestEntry:
    data = document.text.encode("utf-8")
    return ManifestEntry(
        path=document.path,
        source=document.source,
        bytes=len(data),
        sha256=sha256_hex(data),
        split=split_of(document.path, heldout_fraction),
    )


def choose_heldout_sample(entries: Iterable[ManifestEntry], budget: dict[str, int]) -> list[ManifestEntry]:
    """Held-out documents for the shipped sample: in order of their split score, each taken when it
    still fits its source's byte budget; returned in path order."""
    remaining = dict(budget)
    chosen: list[ManifestEntry] = []
    heldout = sorted((e for e in entries if e.split == "heldout"), key=lambda e: heldout_score(e.path))
    for entry in heldout:
        if entry.bytes <= remaining.get(entry.source, 0):
            remaining[entry.source] -= entry.bytes
            chosen.append(entry)
    return sorted(chosen, key=lambda e: e.path)


def join_documents(texts: Iterable[str]) -> str:
    """Documents as one text, separated by ``<|endoftext|>`` (how the trainer sees them too)."""
    return ENDOFTEXT.join(texts)


def split_totals(entries: Iterable[ManifestEntry]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for entry in entries:
        for key in (entry.split, f"{entry.split}/{entry.source}"):
            bucket = totals.setdefault(key, {"files": 0, "bytes": 0})
            bucket["files"] += 1
            bucket["bytes"] += entry.bytes
    return dict(sorted(totals.items()))


def write_corpus(
    documents: Iterable[CorpusDocument],
    out_dir: Path,
    *,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    excluded: list[dict] | None = None,
    sources: dict | None = None,
    sample_budget: dict[str, int] | None = None,
) -> dict:
    """Write each document under ``out_dir/documents/<path>``, the held-out sample as
    ``out_dir/heldout.txt`` and the manifest as ``out_dir/manifest.json``; return the manifest."""
    documents_dir = out_dir / "documents"
    if documents_dir.exists():
        shutil.rmtree(documents_dir)
    entries: list[ManifestEntry] = []
    texts: dict[str, str] = {}
    for document in documents:
        target = documents_dir / document.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(document.text.encode("utf-8"))
        entries.append(manifest_entry(document, heldout_fraction))
        texts[document.path] = document.text
    entries.sort(key=lambda e: e.path)
    sample = choose_heldout_sample(entries, sample_budget or HELDOUT_SAMPLE_BUDGET)
    sample_text = join_documents(texts[e.path] for e in sample)
    sample_bytes = sample_text.encode("utf-8")
    (out_dir / "heldout.txt").write_bytes(sample_bytes)
    manifest = {
        "format": MANIFEST_FORMAT,
        "sources": sources or {},
        "heldout_fraction": heldout_fraction,
        "split_rule": "heldout when int.from_bytes(sha256(path)[:8], 'big') / 2**64 < heldout_fraction",
        "totals": split_totals(entries),
        "heldout_sample": {
            "file": "heldout.txt",
            "separator": ENDOFTEXT,
            "bytes": len(sample_bytes),
            "sha256": sha256_hex(sample_bytes),
            "paths": [e.path for e in sample],
        },
        "excluded": excluded or [],
        "documents": [asdict(e) for e in entries],
    }
    write_manifest(manifest, out_dir / "manifest.json")
    return manifest


def write_manifest(manifest: dict, path: Path) -> None:
    """JSON with one document per line, so that diffs between corpus builds stay readable."""
    head = {k: v for k, v in manifest.items() if k != "documents"}
    lines = json.dumps(head, indent=1)[:-2] + ',\n "documents": [\n'
    lines += ",\n".join("  " + json.dumps(d) for d in manifest["documents"]) + "\n ]\n}\n"
    json.loads(lines)  # the hand-joined layout must stay valid JSON
    path.write_text(lines, encoding="utf-8")


def load_manifest(corpus_dir: Path) -> dict:
    return json.loads((Path(corpus_dir) / "manifest.json").read_text(encoding="utf-8"))


def iter_documents(corpus_dir: Path, split: str | None = None) -> Iterator[tuple[dict, str]]:
    """(manifest entry, text) of a built corpus's documents in path order, optionally one split only;
    raises if a file no longer matches its recorded hash."""
    corpus_dir = Path(corpus_dir)
    for entry in load_manifest(corpus_dir)["documents"]:
        if split is not None and entry["split"] != split:
            continue
        data = (corpus_dir / "documents" / entry["path"]).read_bytes()
        if sha256_hex(data) != entry["sha256"]:
            raise ValueError(f"{entry['path']} does not match the manifest's sha256; rebuild the corpus")
        yield entry, data.decode("utf-8")


def build_corpus(
    out_dir: Path,
    *,
    stdlib_dir: Path | None = None,
    bible_program: str = "bible",
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
) -> dict:
    """Build the full demo corpus (stdlib code + KJV chapters) into ``out_dir``."""
    stdlib_dir = stdlib_dir or default_stdlib_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    excluded: list[dict] = []
    sources = {
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "python_implementation": sys.implementation.name,
        "stdlib_dir": str(stdlib_dir),
        "stdlib_excluded_dirs": sorted(EXCLUDED_STDLIB_DIRS),
        "debian_packages": {name: debian_package_version(name) for name in KJV_PACKAGES},
        "kjv_data_sha256": sha256_hex(KJV_DATA_FILE.read_bytes()) if KJV_DATA_FILE.exists() else None,
        "kjv_command": f"{bible_program} -l 100000 {KJV_FULL_RANGE}",
    }

    def all_documents() -> Iterator[CorpusDocument]:
        yield from stdlib_documents(stdlib_dir, excluded)
        yield from kjv_documents(bible_program)

    return write_corpus(
        all_documents(), out_dir, heldout_fraction=heldout_fraction, excluded=excluded, sources=sources
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to build the corpus in")
    parser.add_argument("--stdlib-dir", type=Path, default=None, help="default: this interpreter's")
    parser.add_argument("--bible-program", default="bible")
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULT_HELDOUT_FRACTION)
    parser.add_argument(
        "--update-package",
        action="store_true",
        help="also copy manifest.json and heldout.txt into the package (corpus_manifest.json, heldout.txt)",
    )
    args = parser.parse_args(argv)
    manifest = build_corpus(
        args.out,
        stdlib_dir=args.stdlib_dir,
        bible_program=args.bible_program,
        heldout_fraction=args.heldout_fraction,
    )
    for name, bucket in manifest["totals"].items():
        print(f"{name:>16}: {bucket['files']:6d} files {bucket['bytes']:>12,d} bytes")
    sample = manifest["heldout_sample"]
    print(f"held-out sample: {len(sample['paths'])} documents, {sample['bytes']:,d} bytes")
    print(f"excluded: {len(manifest['excluded'])} files")
    if args.update_package:
        shutil.copyfile(args.out / "manifest.json", MANIFEST_PATH)
        shutil.copyfile(args.out / "heldout.txt", HELDOUT_TEXT_PATH)
        print(f"wrote {MANIFEST_PATH} and {HELDOUT_TEXT_PATH}")


if __name__ == "__main__":
    main()
