"""Real English text for the quality benchmarks, available offline: the Python tutorial's prose.

Debian's ``python3.11-doc`` package (any ``python3.X-doc`` works) installs the reStructuredText
sources of the CPython documentation under ``/usr/share/doc/python3.X/html/_sources/``. The
documentation is under the PSF License Version 2 (``/usr/share/doc/python3.X-doc/copyright``).
:func:`prose_paragraphs` keeps the prose of one part of it (the tutorial by default): code
blocks, directives, comments, tables and heading underlines are dropped, inline markup such as
``:keyword:`for``` becomes its text, and each paragraph is joined onto one line. What remains
is ordinary English sentences about programming: perplexity text, and filler for the needle test.

A fresh Debian machine gets it with ``apt-get install python3.11-doc``; the benchmarks take
``--corpus DIR`` for any other directory of ``.rst.txt`` / ``.rst`` / ``.txt`` files.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC_ROOTS = "/usr/share/doc/python3*/html/_sources"
CORPUS_NAME = "Python 3 tutorial (Debian python3.X-doc, PSF License v2)"
INSTALL_HINT = "apt-get install python3.11-doc"

_ROLE = re.compile(r":[\w:+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :role:`text <target>` → text
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")  # `text <url>`_ → text
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`_*")
_UNDERLINE = re.compile(r"^([=\-~^\"'*#+`:.])\1{2,}\s*$")


def find_corpus_dir(corpus: str | None = None, part: str = "tutorial") -> Path:
    """The directory of text files to read: ``corpus`` if given, else the installed Python docs'
    ``part``; a missing one is an error saying how to get it."""
    if corpus:
        path = Path(corpus).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"corpus directory {corpus!r} does not exist")
        return path
    roots = [r for r in Path("/").glob(DOC_ROOTS.lstrip("/")) if re.fullmatch(r"python3\.\d+", r.parent.parent.name)]
    for root in sorted(roots, key=lambda r: int(r.parent.parent.name.split(".")[1]), reverse=True):  # newest first
        if (root / part).is_dir():
            return root / part
    raise FileNotFoundError(f"no Python documentation sources under {DOC_ROOTS}/{part}: install them with "
                            f"`{INSTALL_HINT}` (Debian/Ubuntu) or pass --corpus DIR (a directory of text files)")


def corpus_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith((".rst.txt", ".rst", ".txt")))
    if not files:
        raise FileNotFoundError(f"corpus directory {directory} holds no .rst.txt, .rst or .txt files")
    return files


def _clean_inline(line: str) -> str:
    line = _ROLE.sub(lambda m: m.group(1), line)
    line = _LINK.sub(lambda m: m.group(1), line)
    line = _LITERAL.sub(lambda m: m.group(1) or m.group(2), line)
    line = re.sub(r"\s*\[(?:#\w*|\d+)\]_", "", line)  # footnote references
    return line.replace("\\ ", "").replace("|", "")


def prose_paragraphs(text: str, min_words: int = 8) -> list[str]:
    """The prose paragraphs of one reStructuredText file, each on one line."""
    paragraphs, current = [], []
    skip_indented = False  # inside a code block (after "::") or a directive's body
    for raw in text.splitlines() + [""]:
        stripped = raw.strip()
        indented = raw[:1] in (" ", "\t")
        if skip_indented:
            if not stripped or indented:
                continue
            skip_indented = False
        if not stripped:
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        if stripped.startswith(".. ") or stripped == "..":  # directive or comment: its body is indented
            skip_indented = True
            continue
        if _UNDERLINE.match(stripped) or stripped.startswith((">>>", "...", "+", "|")):
            current = []  # a heading's title (the line above) or a table / interactive session
            continue
        if indented and not current:  # an indented block: code or a quotation
            continue
        current.append(stripped)
        if stripped.endswith("::"):
            skip_indented = True
            # reST: "text::" reads "text:"; a "::" after a space disappears
            current[-1] = stripped[:-2].rstrip() if stripped[-3:-2].isspace() or stripped == "::" else stripped[:-1]
            paragraphs.append(" ".join(current))
            current = []
    out = []
    for p in paragraphs:
        p = re.sub(r"\s+", " ", _clean_inline(p)).strip()
        if len(p.split()) >= min_words and p[-1:] in ".:?!)":
            out.append(p)
    return out


def load_prose(corpus: str | None = None, part: str = "tutorial") -> tuple[list[str], Path]:
    """(paragraphs in file order, the directory they came from)."""
    directory = find_corpus_dir(corpus, part)
    paragraphs: list[str] = []
    for f in corpus_files(directory):
        paragraphs += prose_paragraphs(f.read_text(encoding="utf-8", errors="replace"))
    if not paragraphs:
        raise ValueError(f"no prose paragraphs found in {directory}")
    return paragraphs, directory
