"""Caption metrics: the COCO caption evaluation (pycocoevalcap) and exact match.

:func:`caption_metrics` gives the same numbers as pycocoevalcap's ``COCOEvalCap.evaluate()`` on
the same (NFC-normalised) captions, without the annotation/result files: references and
predictions are tokenized separately with the PTB tokenizer and handed to the same scorers.
Without Java it still works, with a Python tokenizer and without METEOR.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import unicodedata
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from pycocoevalcap.bleu.bleu_scorer import BleuScorer
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.spice.spice import Spice
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from captioning.data.vocab import tokenize
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

K = TypeVar("K", bound=Hashable)

METRIC_NAMES = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
# BLEU as Xu et al. (2015, section 5.2) report it, without the brevity penalty, and the
# penalty itself: the standard Bleu_n is Bleu_n_no_bp * Bleu_brevity_penalty.
BLEU_NO_BP_NAMES = ("Bleu_1_no_bp", "Bleu_2_no_bp", "Bleu_3_no_bp", "Bleu_4_no_bp")

_JAVA_CHECK_TIMEOUT_S = 30.0
# PTBTokenizer feeds Java one caption per line and pairs the output lines back up by position, so
# any character Java treats as a line break would shift every later caption onto the wrong image.
# It only replaces "\n" itself; these are the others Java's tokenizer breaks lines at.
_LINE_BREAKS = re.compile("[\r\x0b\x0c\u2028\u2029]")
_NATURAL_SPLIT = re.compile(r"(\d+)")

# Messages already logged by _warn_once, so a training loop that evaluates every epoch warns once.
_warned: set[str] = set()


@functools.cache
def java_available() -> bool:
    """Whether a working ``java`` is on PATH (checked once per process).

    The PTB tokenizer, METEOR and SPICE are Java programs.
    """
    java = shutil.which("java")
    if java is None:
        return False
    try:
        result = subprocess.run(
            [java, "-version"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=_JAVA_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def tokenize_for_eval(captions: Mapping[K, Sequence[str]]) -> dict[K, list[str]]:
    """Tokenize captions the way the COCO caption evaluation does.

    With Java this is pycocoevalcap's ``PTBTokenizer`` (one Java run for all captions); without it,
    :func:`captioning.data.vocab.tokenize`, which gives the same tokens on ordinary captions; one
    known difference is brackets, which PTBTokenizer keeps as ``-lrb-``/``-rrb-`` tokens (it
    lower-cases them before its punctuation filter, which looks for ``-LRB-``), another a lone
    ``/``, which it keeps.

    Captions are NFC-normalised first, as :func:`captioning.data.vocab.tokenize` does: Java keeps
    combining marks as they come, so a reference typed with them ("u" + U+031B + U+0309) would
    not match the same letter generated as one code point ("ử"). PTBTokenizer reads and writes
    UTF-8 whatever the locale (``LANG=C`` included).

    Args:
        captions: raw caption strings per key (image id).

    Returns:
        For every key, its captions in the same order as lower-case tokens joined by spaces, with
        punctuation removed.

    Raises:
        CaptioningError: the Java tokenizer failed or lost captions.
    """
    if not java_available():
        return {key: [" ".join(tokenize(c)) for c in caps] for key, caps in captions.items()}
    payload = {
        key: [{"caption": _LINE_BREAKS.sub(" ", unicodedata.normalize("NFC", c))} for c in caps]
        for key, caps in captions.items()
        if len(caps) > 0
    }
    if not payload:
        return {key: [] for key in captions}
    try:
        tokenized = PTBTokenizer().tokenize(payload)
    except OSError as error:
        # It writes its input to a temp file next to its jar, inside site-packages.
        raise CaptioningError(
            f"the PTB tokenizer failed ({_one_line(error)}); it needs `java` and a writable "
            "pycocoevalcap/tokenizer folder"
        ) from error
    out: dict[K, list[str]] = {}
    for key, caps in captions.items():
        out[key] = tokenized.get(key, [])
        # A crashed Java run yields fewer lines, which PTBTokenizer silently zips away.
        if len(out[key]) != len(caps):
            raise CaptioningError(
                f"the PTB tokenizer returned {len(out[key])} of {len(caps)} captions for {key!r}"
            )
    return out


@contextlib.contextmanager
def _quiet_child_stderr():
    """Send file descriptor 2 to /dev/null while a Java child runs: the PTB tokenizer prints
    a timing line there on every call, which would litter every validation log."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _check_inputs(predictions: Mapping[int, str], references: Mapping[int, Sequence[str]]) -> None:
    if len(predictions) == 0:
        raise CaptioningError("no predictions to score")
    missing = [image_id for image_id in predictions if image_id not in references]
    if missing:
        raise CaptioningError(
            f"no references for image id {missing[0]!r} "
            f"({len(missing)} of {len(predictions)} predicted images have none)"
        )
    for image_id, prediction in predictions.items():
        if not isinstance(prediction, str):
            raise CaptioningError(
                f"the prediction for image id {image_id!r} is a {type(prediction).__name__}, "
                "not a string"
            )
        refs = references[image_id]
        # A bare string is a Sequence too, and would be scored as one reference per character.
        if isinstance(refs, str):
            raise CaptioningError(
                f"the references for image id {image_id!r} must be a list of strings, not a string"
            )
        if len(refs) == 0:
            raise CaptioningError(f"image id {image_id!r} has an empty list of references")


# One METEOR process per Python process, started at the first score and kept: starting it (the
# JVM and the paraphrase tables) takes seconds, a score of a thousand captions a fraction of one,
# so a study that scores many runs pays the start once. Stopped at exit, and after any failure,
# so the next score starts a fresh one.
_meteor_scorer: Meteor | None = None
_meteor_start = threading.Lock()


def _meteor(gts: dict[int, list[str]], res: dict[int, list[str]]) -> float | None:
    global _meteor_scorer
    # A broken METEOR (e.g. a JVM that cannot get its 2 GB heap) must not stop an evaluation.
    with _meteor_start:
        if _meteor_scorer is None:
            try:
                _meteor_scorer = Meteor()
            except Exception as error:
                logger.warning("METEOR failed to start, reported as None: %s", _one_line(error))
                return None
        scorer = _meteor_scorer
    try:
        score, _ = scorer.compute_score(gts, res)
        return float(score)
    except Exception as error:
        _stop_meteor(scorer)
        logger.warning("METEOR failed, reported as None: %s", _one_line(error))
        return None


def _stop_meteor(scorer: Meteor | None = None) -> None:
    """Stop ``scorer`` (by default the kept one), and forget it if it is the kept one."""
    global _meteor_scorer
    with _meteor_start:
        scorer = scorer or _meteor_scorer
        if scorer is None:
            return
        if scorer is _meteor_scorer:
            _meteor_scorer = None
    # compute_score holds its lock when it raises, and Meteor.__del__ takes the same lock to
    # stop the Java process: without this, garbage collection would hang forever.
    if scorer.lock.locked():
        scorer.lock.release()
    process = scorer.meteor_p
    process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        stream.close()


atexit.register(_stop_meteor)


def _spice(gts: dict[int, list[str]], res: dict[int, list[str]]) -> float:
    try:
        score, _ = Spice().compute_score(gts, res)
    except Exception as error:
        raise CaptioningError(
            f"SPICE failed ({_one_line(error)}); it runs Java with 8 GB of heap and downloads "
            "Stanford CoreNLP models on first use"
        ) from error
    return float(score)


def _bleu(
    gts: dict[int, list[str]], res: dict[int, list[str]]
) -> tuple[list[float], dict[str, float]]:
    """Corpus BLEU-1..4 exactly as pycocoevalcap's ``Bleu(4)`` computes it (the reference
    length closest to each caption's), and the same without the brevity penalty.

    The penalty is ``exp(1 - r / c)`` for a corpus of ``c`` caption words against an
    effective reference length ``r`` when ``c < r``, else 1; the same factor scales all
    four orders, so dividing it out gives the BLEU of Xu et al. (2015, section 5.2).
    """
    scorer = BleuScorer(n=4)
    for image_id in gts:
        scorer += (res[image_id][0], gts[image_id])
    bleu, _ = scorer.compute_score(option="closest", verbose=0)
    testlen, reflen = scorer._testlen, scorer._reflen  # of the call above (no public getter)
    ratio = (testlen + 1e-15) / (reflen + 1e-9)  # pycocoevalcap's guards
    penalty = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    brevity = {name: float(b) / penalty for name, b in zip(BLEU_NO_BP_NAMES, bleu)}
    brevity.update(Bleu_brevity_penalty=penalty, Bleu_length_ratio=ratio)
    return [float(b) for b in bleu], brevity


def caption_metrics(
    predictions: Mapping[int, str],
    references: Mapping[int, Sequence[str]],
    spice: bool = False,
    meteor: bool = True,
) -> dict[str, float | None]:
    """BLEU-1..4, METEOR, ROUGE-L and CIDEr-D (and optionally SPICE) of predicted captions.

    The numbers equal those of pycocoevalcap's ``COCOEvalCap`` run on the same images. BLEU is
    corpus-level and CIDEr's document frequencies come from the references of the scored images,
    so scores of subsets do not average to the score of the whole.

    Without Java, captions are tokenized in Python, METEOR is ``None`` (with one warning per
    process) and SPICE is unavailable.

    Args:
        predictions: one raw predicted caption per image id; exactly these images are scored.
        references: raw reference captions per image id (untokenized; extra ids are ignored).
        spice: also compute SPICE (slow; needs Java and, on first use, downloads Stanford
            CoreNLP models).
        meteor: compute METEOR (a Java process that takes seconds to start); without it the
            key is ``None``. Validation during training turns it off.

    Returns:
        ``{"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"}`` (plus ``"SPICE"``
        when asked) as floats; ``METEOR`` is ``None`` when it could not be computed. Beside
        them, BLEU-1..4 without the brevity penalty (:data:`BLEU_NO_BP_NAMES`, the form
        Xu et al. 2015 report), the penalty (``Bleu_brevity_penalty``) and the corpus's
        caption-to-reference length ratio (``Bleu_length_ratio``).

    Raises:
        CaptioningError: no predictions, a predicted image without references, a failing Java
            tokenizer, or SPICE asked for but failing.
    """
    _check_inputs(predictions, references)
    use_java = java_available()
    if not use_java:
        if spice:
            raise CaptioningError("SPICE needs Java, and no working `java` is on PATH")
        _warn_once(
            "no working `java` on PATH: METEOR is not computed and captions are tokenized in "
            "Python, so scores may differ slightly from the official COCO evaluation"
        )
    image_ids = list(predictions)
    gts_raw = {image_id: list(references[image_id]) for image_id in image_ids}
    res_raw = {image_id: [predictions[image_id]] for image_id in image_ids}

    # The scorers print progress and BLEU's internal counts; keep them out of training logs.
    with contextlib.redirect_stdout(io.StringIO()):
        # Separate runs as in COCOEvalCap.evaluate(), so the tokens are the same as there.
        with _quiet_child_stderr():
            gts = tokenize_for_eval(gts_raw)
            res = tokenize_for_eval(res_raw)
        # SPICE first: it is the likeliest to fail, and should do so before the slow scorers.
        spice_score = _spice(gts, res) if spice else None
        bleu, brevity = _bleu(gts, res)
        meteor_score = _meteor(gts, res) if use_java and meteor else None
        rouge, _ = Rouge().compute_score(gts, res)
        cider, _ = Cider().compute_score(gts, res)

    scores: dict[str, float | None] = {f"Bleu_{n + 1}": float(b) for n, b in enumerate(bleu)}
    scores["METEOR"] = meteor_score
    scores.update(brevity)
    scores["ROUGE_L"] = float(rouge)
    scores["CIDEr"] = float(cider)
    if spice:
        scores["SPICE"] = spice_score
    return scores


def _exact_hits(
    predictions: Mapping[int, str], references: Mapping[int, Sequence[str]]
) -> dict[int, bool]:
    _check_inputs(predictions, references)
    return {
        image_id: tokenize(prediction) in [tokenize(r) for r in references[image_id]]
        for image_id, prediction in predictions.items()
    }


def exact_match(predictions: Mapping[int, str], references: Mapping[int, Sequence[str]]) -> float:
    """Share of images whose prediction equals one of its references, ignoring case and punctuation.

    Both sides are compared as :func:`captioning.data.vocab.tokenize` token lists.

    Args:
        predictions: one raw predicted caption per image id.
        references: raw reference captions per image id (extra ids are ignored).

    Raises:
        CaptioningError: no predictions, or a predicted image without references.
    """
    hits = _exact_hits(predictions, references)
    return sum(hits.values()) / len(hits)


def _natural_key(text: str) -> tuple[list[str | int], str]:
    # re.split with a group alternates text and digit runs, so equal positions compare same types.
    parts = _NATURAL_SPLIT.split(text)
    return [int(p) if i % 2 else p for i, p in enumerate(parts)], text


def exact_match_by_group(
    predictions: Mapping[int, str],
    references: Mapping[int, Sequence[str]],
    groups: Mapping[int, Hashable],
) -> dict[str, float]:
    """:func:`exact_match` per group of images (e.g. the number of objects in a shapes image).

    Args:
        predictions: one raw predicted caption per image id.
        references: raw reference captions per image id (extra ids are ignored).
        groups: the group of every predicted image id (extra ids are ignored).

    Returns:
        Exact match per group, keyed by ``str(group)`` in natural order ("2" before "10"), only
        for groups that have predicted images.

    Raises:
        CaptioningError: no predictions, or a predicted image without references or group.
    """
    hits = _exact_hits(predictions, references)
    missing = [image_id for image_id in hits if image_id not in groups]
    if missing:
        raise CaptioningError(
            f"no group for image id {missing[0]!r} "
            f"({len(missing)} of {len(hits)} predicted images have none)"
        )
    by_group: dict[str, list[bool]] = {}
    for image_id, hit in hits.items():
        by_group.setdefault(str(groups[image_id]), []).append(hit)
    return {
        name: sum(by_group[name]) / len(by_group[name])
        for name in sorted(by_group, key=_natural_key)
    }
