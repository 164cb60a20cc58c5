import json
import random
import unicodedata

import pytest

from captioning.data import vocab
from captioning.data.records import ImageRecord
from captioning.data.vocab import SPECIALS, Vocabulary, tokenize
from captioning.errors import DataError


def test_tokenize_matches_coco_conventions():
    assert tokenize("A Man, riding a horse.") == ["a", "man", "riding", "a", "horse"]
    assert tokenize("two shapes : a red circle , a blue square") == [
        "two",
        "shapes",
        "a",
        "red",
        "circle",
        "a",
        "blue",
        "square",
    ]
    assert tokenize('It\'s (very) "big"!  Okay... done.\nNext') == [
        "it",
        "'s",
        "very",
        "big",
        "okay",
        "done",
        "next",
    ]
    assert tokenize("a 3.5 inch screen") == ["a", "3.5", "inch", "screen"]


def test_specials_and_round_trip(tmp_path):
    vocab = Vocabulary.build(["a red circle", "a blue square"])
    assert vocab.itos[:4] == list(SPECIALS)
    ids = vocab.encode("A red square.")
    assert ids[0] == vocab.start_id and ids[-1] == vocab.end_id
    assert vocab.decode(ids) == "a red square"
    assert vocab.decode([vocab.start_id, vocab.stoi["red"], vocab.end_id, vocab.stoi["a"]]) == "red"
    vocab.save(tmp_path / "vocab.json")
    assert Vocabulary.load(tmp_path / "vocab.json").itos == vocab.itos


def test_min_count_and_max_size():
    captions = ["a a a b b c", "a b d"]
    assert set(Vocabulary.build(captions, min_count=2).itos[4:]) == {"a", "b"}
    assert set(Vocabulary.build(captions, max_size=5).itos[4:]) == {"a"}
    # ties broken alphabetically: c and d both occur once
    assert set(Vocabulary.build(captions, max_size=7).itos[4:]) == {"a", "b", "c"}


def test_test_split_word_is_unknown():
    train = [ImageRecord(1, "x.png", "train", ("a red circle", "a circle"))]
    test = [ImageRecord(2, "y.png", "test", ("a green zebra",))]
    vocab = Vocabulary.build(c for r in train for c in r.captions)
    assert "zebra" not in vocab and "green" not in vocab
    ids = vocab.encode(test[0].captions[0], add_special=False)
    assert ids == [vocab.stoi["a"], vocab.unk_id, vocab.unk_id]


def test_bad_vocab_files(tmp_path):
    path = tmp_path / "v.json"
    path.write_text('{"not": "a list"}')
    with pytest.raises(DataError, match="not a vocabulary file"):
        Vocabulary.load(path)
    with pytest.raises(DataError, match="must start with"):
        Vocabulary(["a", "b"])


def _treebank_tokens(text: str) -> list[str]:
    """The slow path of ``tokenize``, always taken."""
    slow = vocab._SENTENCE_PERIOD.sub(r" \1 ", vocab.normalize(text))
    return [
        t
        for t in vocab._treebank.tokenize(slow)
        if t not in vocab._PUNCTUATION and not vocab._ONLY_PUNCTUATION.match(t)
    ]


def test_plain_captions_take_the_fast_path_with_treebank_tokens():
    # The fast path (plain words, at most a final period) must give exactly what the Treebank
    # path gives, contractions included, in any script: Vietnamese words with their
    # diacritics, letters written decomposed (NFD), invisible format characters, other
    # spaces and digits, and the letters that Treebank's case-blind contraction patterns
    # match ("gımme" with a dotless i is "gim me").
    rng = random.Random(0)
    words = [
        "a",
        "man",
        "Dog",
        "2",
        "cannot",
        "gonna",
        "wanna",
        "gotta",
        "lemme",
        "gimme",
        "can",
        "not",
        "riding",
        "x1",
        "a.b",
        "it's",
        "don't",
        "'tis",
        "(red)",
        "-",
        "--",
        "x,",
        "\n",
        ".",
        ",",
        ":",
        "a:",
        "b,",
        ",c",
        "1,000",
        "3:",
        "x:y",
        "Một",
        "người",
        "đàn",
        "ông",
        "ĐANG",
        "đứng",
        "trên",
        "đá",
        "sương",
        "mù",
        "bi-a",
        "Coca-Cola",
        "Ưu",
        "ở,",
        "núi:",
        "\u200b",
        "\ufeff",
        "x\u00ad",
        "u\u031b\u0309a",
        "\u212a",
        "İ",
        "gımme",
        "x\u0302",
        "²",
        "\u0663",
        "\xa0",
        "\t",
        "_",
        "a_b",
        "ß",
        "ǅ",
        "日本",
    ]
    for _ in range(4000):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        text += rng.choice(["", ".", ". ", " .", "  ", "?", "\u200b.", "\t"])
        assert vocab.tokenize(text) == _treebank_tokens(text), ascii(text)
    for plain in [
        "a man riding a horse.",
        "three shapes : a red circle , a blue square",
        "một người đàn ông , đang đứng trên đá .",
    ]:
        assert vocab._PLAIN.fullmatch(plain)  # the fast path is taken
    assert vocab.tokenize("we cannot go.") == ["we", "can", "not", "go"]
    assert vocab.tokenize("GIMME gımme") == ["gim", "me", "gım", "me"]


# Captions of the Vietnamese photos in ../shared/data/photos_vi (as published: the second
# holds two zero-width spaces, the third a tab before its final period).
VIETNAMESE = [
    "Một người đàn ông đang đứng trên đá của đỉnh núi tuyết bao quanh là sương mù .",
    "Một cậu bé mặc áo nâu suýt chạm vào chân mình với hai tay giơ lên \u200b\u200btrời .",
    "Một cửa hàng bán bóng đồ chơi, ô và vậ\t .",
    '"Mọi người ngồi bên đài phun nước, một chàng trai có tóc tím nói chuyện với một chàng '
    'trai đội mũ ."',
    "Một con chó nhỏ ngủ một phần trên khăn và một phần trên đất và cỏ với hai lít Coca-Cola "
    "rỗng trong bàn chân .",
]


def test_vietnamese_captions():
    assert tokenize(VIETNAMESE[0]) == [
        "một",
        "người",
        "đàn",
        "ông",
        "đang",
        "đứng",
        "trên",
        "đá",
        "của",
        "đỉnh",
        "núi",
        "tuyết",
        "bao",
        "quanh",
        "là",
        "sương",
        "mù",
    ]
    assert tokenize(VIETNAMESE[1])[-2:] == ["lên", "trời"]  # the zero-width spaces are gone
    assert tokenize(VIETNAMESE[2]) == [
        "một",
        "cửa",
        "hàng",
        "bán",
        "bóng",
        "đồ",
        "chơi",
        "ô",
        "và",
        "vậ",
    ]
    assert tokenize(VIETNAMESE[3])[:3] == ["mọi", "người", "ngồi"]  # quotes dropped
    assert "coca-cola" in tokenize(VIETNAMESE[4])
    for caption in VIETNAMESE:
        assert tokenize(caption) == _treebank_tokens(caption)
        decomposed = unicodedata.normalize("NFD", caption)
        assert decomposed != caption and tokenize(decomposed) == tokenize(caption)
        assert tokenize(caption.upper()) == tokenize(caption)
    # The plain ones take the fast path; the quoted one does not need to.
    assert [bool(vocab._PLAIN.fullmatch(vocab.normalize(c))) for c in VIETNAMESE] == [
        True,
        True,
        True,
        False,
        False,
    ]
    # Invisible format characters go, other characters stay.
    assert vocab.normalize("\ufeffđá\u00ad\u200bnúi\u2060 ,\u00a0x") == "đánúi , x"


def test_vietnamese_vocabulary_round_trips_readably(tmp_path):
    vocabulary = Vocabulary.build(VIETNAMESE)
    assert {"người", "đỉnh", "trời", "coca-cola"} <= set(vocabulary.itos)
    path = tmp_path / "vocab.json"
    vocabulary.save(path)
    text = path.read_bytes().decode("utf-8")
    assert "đỉnh" in text and "\\u" not in text  # letters, not escapes
    assert Vocabulary.load(path).itos == vocabulary.itos
    ids = vocabulary.encode(VIETNAMESE[0])
    assert vocabulary.decode(ids) == " ".join(tokenize(VIETNAMESE[0]))
    # A file written with escapes (the old way) reads back the same.
    path.write_text(json.dumps(vocabulary.itos), encoding="ascii")
    assert Vocabulary.load(path).itos == vocabulary.itos
