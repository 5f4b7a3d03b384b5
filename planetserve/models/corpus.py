"""The training corpus: text that every Python installation carries, so no machine has to download any.

Documents are the docstrings of the standard library's modules, classes and functions (parsed with
`ast`, never imported) and the language-reference help topics of `pydoc_data`. Files are read in
sorted path order, each document is normalised the same fixed way, and an exact duplicate keeps only
its first occurrence, so the corpus depends only on the stdlib's files, not on the machine or process.

Directories that distributions strip or that hold test data (`test`, `tests`, `idle_test`,
`site-packages`, ...) are skipped: what remains is the same on every install of one Python version.

Parsing the stdlib takes seconds, which a verifier restarted inside its plan window cannot spare, so a
built corpus is kept in the data directory's `corpus/`, in a file named for what it was built from (this
module's source, the interpreter, each file's path, size and modification time): any change to those
builds it afresh.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import re
import sys
import sysconfig
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import msgpack

from planetserve.models.layout import data_dir

SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"})
TOPICS_FILE = Path("pydoc_data") / "topics.py"
MIN_CHARS = 24
"""Shorter docstrings ("Return self.", "Docstring.") repeat across classes and teach nothing."""
HELD_OUT_PER_256 = 13
"""About 5% of documents, picked by their text's hash, are held out of tokenizer and model training."""

_TRAILING_SPACE = re.compile(r"[ \t]+\n")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class Document:
    title: str
    """Dotted name of what the docstring documents (`json.dumps`), or `topic:<name>` for help topics."""
    kind: str
    """module, class, function or topic."""
    text: str

    @property
    def held_out(self) -> bool:
        return hashlib.sha256(self.text.encode()).digest()[0] < HELD_OUT_PER_256


@dataclass(frozen=True)
class Corpus:
    documents: tuple[Document, ...]
    files: int
    """Source files read."""

    @cached_property
    def train(self) -> tuple[Document, ...]:
        return tuple(d for d in self.documents if not d.held_out)

    @cached_property
    def held_out(self) -> tuple[Document, ...]:
        return tuple(d for d in self.documents if d.held_out)

    def to_bytes(self) -> bytes:
        """One canonical serialisation: what the corpus hash and the determinism checks cover."""
        return "".join(f"\x1e{d.kind}\x1f{d.title}\x1f{d.text}" for d in self.documents).encode()

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def stats(self) -> dict[str, int | str]:
        return {
            "files": self.files,
            "documents": len(self.documents),
            "train_documents": len(self.train),
            "held_out_documents": len(self.held_out),
            "chars": sum(len(d.text) for d in self.documents),
            "bytes": len(self.to_bytes()),
            "sha256": self.sha256,
        }


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def normalise(text: str) -> str:
    """NFC, Unix newlines, no trailing spaces, at most one blank line in a row, stripped ends."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_SPACE.sub("\n", text.expandtabs(8) + "\n")
    return _BLANK_RUNS.sub("\n\n", text).strip()


def source_files(root: Path) -> list[Path]:
    """The `.py` files under root in relative-path order, skipped directories never walked into."""
    files = []
    for folder, dirs, names in os.walk(root):
        top = Path(folder) == root
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not (top and d.startswith("config-"))]
        files += [Path(folder, name) for name in names
                  if name.endswith(".py") and not (top and name.startswith("config-"))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _cache_key(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"\0{sys.implementation.cache_tag}\0{sys.version}\0{root}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"\0{path.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


Documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _docstrings(node: Documented, prefix: str, kind: str) -> Iterator[tuple[str, str, str]]:
    """(title, kind, raw docstring) in source order, nested definitions after their parent."""
    doc = ast.get_docstring(node, clean=True)
    if doc:
        yield prefix, kind, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield from _docstrings(child, f"{prefix}.{child.name}", "class")
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _docstrings(child, f"{prefix}.{child.name}", "function")


def _topics(source: bytes) -> Iterator[tuple[str, str, str]]:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            topics = ast.literal_eval(node.value)
            for name in sorted(topics):
                yield f"topic:{name}", "topic", topics[name]


def _read_cached(path: Path) -> Corpus | None:
    """The corpus kept at path, or None where there is none or it does not match its own digest."""
    try:
        files, digest, entries = msgpack.unpackb(path.read_bytes())
        corpus = Corpus(documents=tuple(Document(*entry) for entry in entries), files=files)
    except (OSError, ValueError, TypeError, msgpack.UnpackException):
        return None
    return corpus if corpus.sha256 == digest else None


def _write_cached(path: Path, corpus: Corpus) -> None:
    """Atomically, and not at all where the cache cannot be written: it only saves time."""
    entries = [(d.title, d.kind, d.text) for d in corpus.documents]
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(msgpack.packb([corpus.files, corpus.sha256, entries]))
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def build_corpus(root: Path | None = None) -> Corpus:
    """The corpus of root (the running interpreter's stdlib), from the cache where it was built before."""
    root = root or stdlib_dir()
    files = source_files(root)
    cached = data_dir() / "corpus" / f"corpus-{_cache_key(root, files)}.msgpack"
    corpus = _read_cached(cached)
    if corpus is None:
        corpus = parse_corpus(root, files)
        _write_cached(cached, corpus)
    return corpus


def parse_corpus(root: Path, files: list[Path]) -> Corpus:
    seen: set[str] = set()
    documents: list[Document] = []
    for path in files:
        source = path.read_bytes()
        try:
            raw = (
                _topics(source)
                if path.relative_to(root) == TOPICS_FILE
                else _docstrings(ast.parse(source), module_name(root, path), "module")
            )
            entries = list(raw)
        except (SyntaxError, ValueError):
            continue  # a file this interpreter cannot parse is left out the same way on every run
        for title, kind, text in entries:
            text = normalise(text)
            if len(text) >= MIN_CHARS and text not in seen:
                seen.add(text)
                documents.append(Document(title=title, kind=kind, text=text))
    if not documents:
        raise RuntimeError(f"no documentation found under {root}: is it a Python standard library?")
    return Corpus(documents=tuple(documents), files=len(files))
