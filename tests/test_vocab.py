import random

import pytest

from captioning import vocab
from captioning.data.records import ImageRecord
from captioning.errors import DataError
from captioning.vocab import SPECIALS, Vocabulary, tokenize


def test_tokenize_matches_coco_conventions():
    assert tokenize("A Man, riding a horse.") == ["a", "man", "riding", "a", "horse"]
    assert tokenize("two shapes : a red circle , a blue square") == [
        "two", "shapes", "a", "red", "circle", "a", "blue", "square",
    ]  # fmt: skip
    assert tokenize("It's (very) \"big\"!  Okay... done.\nNext") == [
        "it", "'s", "very", "big", "okay", "done", "next",
    ]  # fmt: skip
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


def test_plain_captions_take_the_fast_path_with_treebank_tokens():
    # The fast path (plain lower-case words, at most a final period) must give exactly what
    # the Treebank path gives, contractions included.
    rng = random.Random(0)
    words = ["a", "man", "Dog", "2", "cannot", "gonna", "wanna", "gotta", "lemme", "gimme",
             "can", "not", "riding", "x1", "a.b", "it's", "don't", "'tis", "(red)", "-", "--",
             "x,", "\n", ".", ",", ":", "a:", "b,", ",c", "1,000", "3:", "x:y"]  # fmt: skip
    for _ in range(3000):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        text += rng.choice(["", ".", ". ", " .", "  ", "?"])
        slow = vocab._SENTENCE_PERIOD.sub(r" \1 ", text.lower().replace("\n", " "))
        expected = [
            t for t in vocab._treebank.tokenize(slow)
            if t not in vocab._PUNCTUATION and not vocab._ONLY_PUNCTUATION.match(t)
        ]  # fmt: skip
        assert vocab.tokenize(text) == expected, text
    for plain in ["a man riding a horse.", "three shapes : a red circle , a blue square"]:
        assert vocab._PLAIN.fullmatch(plain)  # the fast path is taken
    assert vocab.tokenize("we cannot go.") == ["we", "can", "not", "go"]
