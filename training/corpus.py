"""Build the default model's corpus: English prose from the Python 3.11 documentation (Debian's python3.11-doc).

The documentation's text is under the PSF License Agreement (see training/README.md). We take the Texinfo file
(``/usr/share/info/python3.11.info.gz``), drop node headers, menus, footnote URLs, cross-reference targets and
code blocks, and keep prose paragraphs. Nodes are split deterministically: every 20th node is held out.

Usage: python training/corpus.py PYTHON3.11.INFO.GZ OUT_DIR  -> OUT_DIR/{train.txt, heldout.txt, cloze.jsonl}
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

NOTE = re.compile(r"\*note ([^:*]+?)(?:: *[^.,;)]*?)?[.,;)]?(?=\s|$)", re.S)
LEFTOVER_NOTE = re.compile(r"\*?: [0-9a-f]{1,4}\.")  # ": 179." after names the first pattern cannot take
FOOTNOTE_REF = re.compile(r"\(\d+\)")
SPACES = re.compile(r"\s+")
QUOTES = str.maketrans({"‘": "'", "’": "'", "“": '"', "”": '"'})


def paragraphs(node: str) -> list[str]:
    """Prose paragraphs of one info node (code blocks, lists of links, headings dropped)."""
    out = []
    for block in re.split(r"\n\s*\n", node):
        lines = block.splitlines()
        if not lines or any(ln.startswith(("     ", "\t")) and not ln.strip().startswith("*") for ln in lines):
            continue  # indented 5+ spaces: code, tables or nested examples
        text = " ".join(ln.strip() for ln in lines)
        if text.startswith(("* Menu", "File:", "(1)", "   ")) or re.match(r"^\(\d+\) http", text):
            continue
        if re.match(r"^[\d.]+ [^.]*$", text) or set(text) <= set("-=*. "):
            continue  # section numbers and underlines
        text = NOTE.sub(lambda m: m.group(1), text)
        text = LEFTOVER_NOTE.sub("", text.replace("*note ", ""))
        text = FOOTNOTE_REF.sub("", text).translate(QUOTES)
        text = SPACES.sub(" ", text).strip()
        words = text.split()
        letters = sum(c.isalpha() for c in text)
        if len(words) >= 8 and letters > 0.7 * len(text.replace(" ", "")) and text[-1] in ".:!?":
            out.append(text)
    return out


def cloze_passages(paragraphs_: list[str], limit: int = 300, max_words: int = 80) -> list[str]:
    """LAMBADA-style passages: held-out paragraphs ending in a plain word of 4+ letters (final punctuation cut)."""
    out = []
    for para in paragraphs_:
        text = para.rstrip(".:!?")
        words = text.split()
        last = words[-1] if words else ""
        if len(words) >= 15 and last.isalpha() and last.isascii() and len(last) >= 4:
            out.append(" ".join(words[-max_words:]))
        if len(out) >= limit:
            break
    return out


def build(info_gz: Path, out_dir: Path) -> tuple[int, int]:
    """Write train.txt, heldout.txt (one paragraph per line) and cloze.jsonl; returns the text sizes in bytes."""
    raw = gzip.open(info_gz, "rt", encoding="utf-8").read()
    nodes = raw.split("\x1f")
    train, held = [], []
    for i, node in enumerate(nodes):
        (held if i % 20 == 7 else train).extend(paragraphs(node))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (out_dir / "heldout.txt").write_text("\n".join(held) + "\n", encoding="utf-8")
    cloze = [json.dumps({"text": t}) for t in cloze_passages(held)]
    (out_dir / "cloze.jsonl").write_text("\n".join(cloze) + "\n", encoding="utf-8")
    return (out_dir / "train.txt").stat().st_size, (out_dir / "heldout.txt").stat().st_size


if __name__ == "__main__":
    sizes = build(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"train.txt {sizes[0]} bytes, heldout.txt {sizes[1]} bytes")
