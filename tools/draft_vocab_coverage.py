"""How much of real text a draft vocabulary of N token ids covers, in Qwen's vocabulary: the first
N ids, and the N ids most frequent in the text's other half (what engine/draft_vocab.py ranks).

A draft drawn from N ids can only be accepted where the verified token is one of them, so per
draft position acceptance with the smaller vocabulary is at least the whole vocabulary's minus
the share of verified tokens outside it (a draft the cut changes was either wrong already or
becomes the best of what is left). Over real text that share is 1 - coverage: this tool measures
it, with Qwen's own byte-level BPE (the ranks file `qwen.tiktoken`, ids 0..151642, which Qwen2,
Qwen2.5 and Qwen3 share) and its pre-tokenizer, on text no choice here was fitted to:

- code: the Python standard library's sources on this machine;
- prose: the English of Python's own reference topics (pydoc_data.topics);
- translations: every message of a Django wheel's .po catalogues, by language (first ids only:
  a few thousand tokens a language are too few to rank 32,768 ids from);
- Chinese: words drawn from jieba's word list by their corpus frequency (two independent draws:
  one ranks, the other is measured).

Each text is split in two (files, topics, draws): "ranked" counts ids in the first half and
measures the second.

    pip install tiktoken
    python tools/draft_vocab_coverage.py --ranks qwen.tiktoken --django DIR --jieba dict.txt --out RESULT.json

`qwen.tiktoken` ships in the `dashscope` wheel (dashscope/resources/); DIR is an unpacked Django
wheel; dict.txt is jieba/dict.txt of the jieba sdist. Needs no model and no GPU.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from pathlib import Path

import numpy as np

PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
       r"""|\s+(?!\S)|\s+""")
SIZES = (8192, 16384, 32768, 65536)
VOCAB = 151643  # Qwen's BPE tokens (the special tokens after them never occur in text)
LANGUAGES = ("de", "fr", "es", "pt_BR", "it", "ru", "uk", "pl", "tr", "ar", "he", "hi", "ja", "ko",
             "zh_Hans", "zh_Hant", "vi", "th")


def encoder(ranks_path: Path):
    import tiktoken

    ranks = {}
    for line in ranks_path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding("qwen", pat_str=PAT, mergeable_ranks=ranks, special_tokens={})


def coverage(ids: np.ndarray, train: np.ndarray | None = None) -> dict:
    """Shares of `ids` inside the first N ids and, given `train`, inside the N ids most frequent
    there (ties and unseen ids in id order, as engine/draft_vocab.py ranks them)."""
    row = {"tokens": int(len(ids)), "first": {str(n): round(float((ids < n).mean()), 4) for n in SIZES}}
    if train is not None:
        counts = np.bincount(train, minlength=VOCAB)
        rank = np.empty(VOCAB, dtype=np.int64)
        rank[np.lexsort((np.arange(VOCAB), -counts))] = np.arange(VOCAB)
        row["ranked"] = {str(n): round(float((rank[ids] < n).mean()), 4) for n in SIZES}
    return row


def po_messages(path: Path) -> str:
    """The translated strings (msgstr) of a .po file, the header entry skipped."""
    out, current, inside = [], [], False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() + [""]:
        if line.startswith("msgstr"):
            inside, current = True, [line.split(" ", 1)[1] if " " in line else '""']
        elif inside and line.startswith('"'):
            current.append(line)
        elif inside:
            text = "".join(json.loads(s) if s.startswith('"') else "" for s in current)
            if text and "Content-Type" not in text:
                out.append(text)
            inside = False
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=Path, required=True)
    ap.add_argument("--django", type=Path)
    ap.add_argument("--jieba", type=Path)
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="of standard library source")
    ap.add_argument("--words", type=int, default=300_000, help="Chinese words a draw")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    enc = encoder(args.ranks)
    ids = lambda text: np.asarray(enc.encode_ordinary(text), dtype=np.int64)  # noqa: E731
    result = {"vocabulary": "qwen.tiktoken", "sizes": SIZES, "coverage": {}}

    stdlib = Path(re.__file__).parent.parent
    files, used = [], 0
    for f in sorted(stdlib.glob("*.py")):
        if used >= args.max_bytes:
            break
        files.append(f.read_text(encoding="utf-8", errors="replace"))
        used += len(files[-1])
    halves = lambda parts: (ids("\n".join(parts[0::2])), ids("\n".join(parts[1::2])))  # noqa: E731
    train, test = halves(files)
    result["coverage"]["python code (stdlib)"] = coverage(test, train)

    from pydoc_data import topics

    train, test = halves([topics.topics[k] for k in sorted(topics.topics)])
    result["coverage"]["English prose (pydoc topics)"] = coverage(test, train)

    if args.django:
        for lang in LANGUAGES:
            texts = [po_messages(p) for p in sorted(args.django.rglob(f"locale/{lang}/LC_MESSAGES/*.po"))]
            if any(texts):
                result["coverage"][f"Django messages, {lang}"] = coverage(ids("\n".join(texts)))

    if args.jieba:
        words, freqs = [], []
        for line in args.jieba.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) >= 2:
                words.append(parts[0])
                freqs.append(float(parts[1]))
        encoded = [np.asarray(enc.encode_ordinary(w), dtype=np.int64) for w in words]
        p = np.asarray(freqs) / sum(freqs)
        rng = np.random.default_rng(0)
        train, test = (np.concatenate([encoded[i] for i in rng.choice(len(words), args.words, p=p)])
                       for _ in range(2))
        result["coverage"]["Chinese words (jieba, drawn by frequency)"] = coverage(test, train)

    width = max(map(len, result["coverage"]))
    print(f"{'text':<{width}}  tokens    first " + " ".join(f"{n:>6}" for n in SIZES)
          + "    ranked " + " ".join(f"{n:>6}" for n in SIZES))
    for name, row in result["coverage"].items():
        ranked = " ".join(f"{row['ranked'][str(n)]:>6.3f}" for n in SIZES) if "ranked" in row else ""
        print(f"{name:<{width}}  {row['tokens']:>8}        " + " ".join(f"{row['first'][str(n)]:>6.3f}" for n in SIZES)
              + "           " + ranked)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
