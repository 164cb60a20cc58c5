"""Tokenizer and vocabulary.

The tokenizer follows the COCO caption evaluation (PTB tokenization, lower case, punctuation
tokens dropped) but needs no downloads: nltk's Treebank tokenizer is pure regular expressions.
It works on any script: text is NFC-normalised first, so a letter with diacritics is one
character whichever way it was typed (Vietnamese "ử" as one code point or as "u" plus two
combining marks), and invisible format characters (zero-width space, byte order mark, soft
hyphen) are dropped.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from nltk.tokenize import TreebankWordTokenizer

from captioning.errors import DataError
from captioning.files import open_unlinked

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)

# The punctuation tokens that pycocoevalcap's PTBTokenizer removes, plus the quote forms that
# nltk's Treebank tokenizer produces.
_PUNCTUATION = {
    "''",
    "'",
    "``",
    "`",
    '"',
    "-LRB-",
    "-RRB-",
    "-LCB-",
    "-RCB-",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ".",
    "?",
    "!",
    ",",
    ":",
    "-",
    "--",
    "...",
    ";",
}
_ONLY_PUNCTUATION = re.compile(r"^[^\w<>]+$")
# Treebank splits a period off only at the end of the text; split it before any whitespace too.
_SENTENCE_PERIOD = re.compile(r"(\.+)(?=\s|$)")
_treebank = TreebankWordTokenizer()
# Most captions are words (letters and digits of any script) and spaces, commas and colons
# before a space, and at most a final period: Treebank splits those at the spaces and the
# punctuation (which is dropped) unless a word is one of its contractions ("cannot" → "can
# not"; Treebank matches them ignoring case, where "ı" counts as "i").
_PLAIN = re.compile(r"[\w ]*(?:[,:](?= |$)[\w ]*)*(?:\. *)?")
_PLAIN_PUNCTUATION = str.maketrans(",:.", "   ")
_CONTRACTED = re.compile(r"(?i)\b(?:cannot|gimme|gonna|gotta|lemme|wanna)\b")
# Format characters (category Cf) are neither word characters nor whitespace: only these
# candidates need their category looked up.
_NOT_WORD_OR_SPACE = re.compile(r"[^\w\s]")


def _drop_format_character(match: re.Match[str]) -> str:
    character = match.group()
    return "" if unicodedata.category(character) == "Cf" else character


def normalize(text: str) -> str:
    """A caption as :func:`tokenize` reads it: lower case, NFC, without invisible format
    characters (category Cf), every run of whitespace one space.

    >>> normalize("Hai  con chó\u200b\tĐỨNG .")
    'hai con chó đứng .'
    """
    if not text.isascii():
        text = _NOT_WORD_OR_SPACE.sub(_drop_format_character, text)
        text = unicodedata.normalize("NFC", text.lower())
    else:
        text = text.lower()
    return " ".join(text.split())


def tokenize(text: str) -> list[str]:
    """Split a caption into lower-case word tokens, dropping punctuation (see :func:`normalize`
    for what happens to the text first).

    >>> tokenize("A man, riding a horse.")
    ['a', 'man', 'riding', 'a', 'horse']
    >>> tokenize("Một người đàn ông đang đứng trên đá .")
    ['một', 'người', 'đàn', 'ông', 'đang', 'đứng', 'trên', 'đá']
    """
    text = normalize(text)
    if _PLAIN.fullmatch(text) and not _CONTRACTED.search(text):
        return text.translate(_PLAIN_PUNCTUATION).split()  # what Treebank gives, 40x faster
    text = _SENTENCE_PERIOD.sub(r" \1 ", text)
    tokens = _treebank.tokenize(text)
    return [t for t in tokens if t not in _PUNCTUATION and not _ONLY_PUNCTUATION.match(t)]


class Vocabulary:
    """A fixed word list with the specials ``<pad> <start> <end> <unk>`` at ids 0-3.

    Args:
        words: every token, specials first, in id order (as returned by :meth:`to_list`).
    """

    def __init__(self, words: Sequence[str]) -> None:
        if tuple(words[: len(SPECIALS)]) != SPECIALS:
            raise DataError(
                f"vocabulary must start with {' '.join(SPECIALS)}; got {list(words[:4])}"
            )
        if len(set(words)) != len(words):
            raise DataError("vocabulary has repeated words")
        self.itos: list[str] = list(words)
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}

    pad_id = 0
    start_id = 1
    end_id = 2
    unk_id = 3

    @classmethod
    def build(
        cls,
        captions: Iterable[str | Sequence[str]],
        min_count: int = 1,
        max_size: int | None = None,
    ) -> Vocabulary:
        """Count words over ``captions`` (raw strings or token lists) and keep the frequent ones.

        Pass only training-split captions: words seen elsewhere must stay ``<unk>``.

        Args:
            captions: raw caption strings or already tokenized captions.
            min_count: a word must occur at least this often to be kept.
            max_size: the most words kept, specials included; the most frequent win,
                ties broken alphabetically so the result is deterministic.
        """
        counts: Counter[str] = Counter()
        for caption in captions:
            counts.update(tokenize(caption) if isinstance(caption, str) else caption)
        kept = sorted(
            (w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
            key=lambda w: (-counts[w], w),
        )
        if max_size is not None:
            kept = kept[: max(0, max_size - len(SPECIALS))]
        return cls([*SPECIALS, *sorted(kept)])

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: str) -> bool:
        return word in self.stoi

    def encode(self, caption: str | Sequence[str], add_special: bool = True) -> list[int]:
        """Token ids of a caption; with ``add_special`` wrapped in ``<start> … <end>``."""
        tokens = tokenize(caption) if isinstance(caption, str) else caption
        ids = [self.stoi.get(t, self.unk_id) for t in tokens]
        return [self.start_id, *ids, self.end_id] if add_special else ids

    def decode_tokens(self, ids: Iterable[int]) -> list[str]:
        """Words of a generated sequence: stops at ``<end>``, skips ``<start>`` and ``<pad>``."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.end_id:
                break
            if i in (self.start_id, self.pad_id):
                continue
            words.append(self.itos[i])
        return words

    def decode(self, ids: Iterable[int]) -> str:
        """The caption string of a generated sequence (see :meth:`decode_tokens`)."""
        return " ".join(self.decode_tokens(ids))

    def to_list(self) -> list[str]:
        return list(self.itos)

    def save(self, path: str | Path) -> None:
        """Write the words as a JSON list, one a line, in UTF-8 (letters, not escapes)."""
        text = json.dumps(self.itos, indent=0, ensure_ascii=False) + "\n"
        with open_unlinked(path, text=True) as handle:  # never through a link left there
            handle.write(text)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read a file written by :meth:`save` (escaped or not)."""
        try:
            words = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read vocabulary {path}: {exc}") from exc
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DataError(f"{path} is not a vocabulary file (expected a JSON list of words)")
        return cls(words)
