"""Where each word is on the grid, learnt from captions alone: the word localiser that
``model.word_maps`` trains beside the decoder, and whose maps ``train.word_map_weight``
draws each word's attention toward.

A word's score at cell l is linear in the cell, through a low-rank factor shared by the
vocabulary: s_lw = u_w . (P a_l) + b_w. Whether the word is in the caption is read from the
log-sum-exp pooling of its scores over the L cells (Pinheiro and Collobert 2015),

    z_w = (1 / r) log (1 / L) sum_l exp(r s_lw),

trained by binary cross-entropy: the words of each caption are its positives, the other
words of the batch its negatives (in-batch candidates keep the cost at the words the batch
holds rather than the whole vocabulary). With ``train.word_map_labels=image`` the positives
are the words of every reference caption of the image (``ImageWords`` of
:mod:`captioning.objectives.cross_entropy`), so that a word one reference names and another
does not is never a negative. The pooling's weights m_w = softmax_l(r s_lw) are
the word's map: the cells whose evidence says the word is there. It is the probe of
``tools/grid_probe.py`` with the captions' words for labels, trained with the captioner.

With ``model.word_map_classes=categories`` the words that name one category (through a map
of words to categories: "man", "woman", "boy" and "people" to person, "dog" and "puppy" to
dog) share one class: one score per cell, one presence label (the category is named in the
caption), one map. A word's class asks only whether its category is there, not which of
its words the caption chose (a man rather than a woman, one dog rather than two), which is
what the grid probe's categories ask and what lets its maps find the object
(docs/grounding.md). Neural Baby Talk (Lu et al. 2018) ties a caption's words to detector
categories the same way. Words that name no category keep their own class.

The localiser's maps are targets only: the map term KL(m_{y_t} || alpha_t) moves the
attention, never the localiser (its maps are detached), so the two cannot meet at an even
map. Decoding never uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioning.models.packing import Linear

# r of the log-sum-exp pooling and of the maps (the probe's value): 0 would pool by the
# mean, infinity by the maximum
SHARPNESS = 5.0
# the special tokens (<pad> <start> <end> <unk>: captioning.data.vocab.Vocabulary's ids 0-3),
# which name nothing in the image
SPECIAL_IDS = (0, 1, 2, 3)


@dataclass
class WordMaps:
    """The localiser's outputs for a batch of captions.

    Attributes:
        presence: (B, C) the pooled logit of each candidate word in each caption's image.
        labels: (B, C) 1 where the candidate is one of the caption's words.
        candidates: (C,) bool, the candidates that are words (not special tokens).
        log_maps: (B, T, L) log m_{y_t}, the map of each target word, detached.
        words: (B, T) bool, the targets that have a map (real words, not specials or
            padding).
    """

    presence: torch.Tensor
    labels: torch.Tensor
    candidates: torch.Tensor
    log_maps: torch.Tensor
    words: torch.Tensor


class WordLocaliser(nn.Module):
    """Per-cell word scores of rank ``rank`` over a grid of ``feature_dim`` channels.

    Args:
        feature_dim: D, the grid's channels.
        vocab_size: V.
        rank: the size of the shared projection P (its cost is B * L * D * rank).
        sharpness: r of the pooling and the maps.
    """

    def __init__(
        self,
        feature_dim: int,
        vocab_size: int,
        rank: int = 256,
        sharpness: float = SHARPNESS,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.project = Linear(feature_dim, rank)
        self.words = nn.Embedding(vocab_size, rank)
        self.bias = nn.Embedding(vocab_size, 1)
        nn.init.normal_(self.words.weight, std=rank**-0.5)
        nn.init.zeros_(self.bias.weight)
        self.sharpness = sharpness
        # each word's class (a word id), saved with the weights and set by tie(); None: each
        # word is its own
        self.register_buffer("classes", torch.arange(vocab_size) if tied else None)

    def tie(self, classes: torch.Tensor) -> None:
        """Give each word id the class ``classes`` (V,) says: the id of the word whose
        score, label and map it shares (its own id: its own class)."""
        if self.classes is None:
            raise ValueError("the localiser was built without classes (tied=False)")
        if classes.shape != self.classes.shape or bool((classes[classes] != classes).any()):
            raise ValueError("classes must map each word id to an id that is its own class")
        self.classes.copy_(classes)

    def class_of(self, words: torch.Tensor) -> torch.Tensor:
        """The class of each word id of ``words`` (any shape)."""
        return words if self.classes is None else self.classes[words]

    def class_weights(self) -> torch.Tensor:
        """u of each word's class (V, R)."""
        weight = self.words.weight
        return weight if self.classes is None else weight[self.classes]

    def scores(self, cells: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """s_lw for the cells (B, L, D) and word ids (C,) → (B, L, C)."""
        words = self.class_of(words)
        return self.project(cells) @ self.words(words).t() + self.bias(words).t()

    def maps(self, cells: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """m_w, each word's map over the cells: (B, L, D), (C,) → (B, L, C)."""
        return torch.softmax(self.sharpness * self.scores(cells, words).float(), dim=1)

    def forward(
        self, cells: torch.Tensor, targets: torch.Tensor, present: torch.Tensor | None = None
    ) -> WordMaps:
        """The presence logits of the batch's words and each target's map: cells (B, L, D)
        and the captions' next words ``targets`` (B, T, padded). ``present`` (B, K, padded
        with specials), the words known to be in each image, are the positives and join the
        candidates; None: each caption's own words."""
        steps = targets.shape[1]
        words = targets if present is None else torch.cat([targets, present], dim=1)
        words = self.class_of(words)
        candidates, index = torch.unique(words, return_inverse=True)  # (C,), (B, T [+ K])
        scaled = self.sharpness * self.scores(cells, candidates).float()  # (B, L, C)
        cells_count = scaled.shape[1]
        presence = torch.logsumexp(scaled, dim=1) - torch.log(torch.tensor(float(cells_count)))
        presence = presence / self.sharpness  # (B, C)
        positives = index if present is None else index[:, steps:]
        labels = torch.zeros_like(presence).scatter_(1, positives, 1.0)  # (B, C)
        index = index[:, :steps]  # (B, T)
        log_maps = torch.log_softmax(scaled.detach(), dim=1)  # (B, L, C)
        gathered = log_maps.gather(2, index.unsqueeze(1).expand(-1, cells_count, -1))
        special = torch.tensor(SPECIAL_IDS, device=targets.device)
        return WordMaps(
            presence=presence,
            labels=labels,
            candidates=~torch.isin(candidates, special),
            log_maps=gathered.transpose(1, 2),  # (B, T, L)
            words=~torch.isin(targets, special),
        )


def presence_loss(maps: WordMaps) -> torch.Tensor:
    """The localiser's binary cross-entropy, averaged over the captions and their word
    candidates (specials left out)."""
    loss = F.binary_cross_entropy_with_logits(maps.presence, maps.labels, reduction="none")
    keep = maps.candidates.float()  # (C,)
    return (loss * keep).sum() / (keep.sum() * loss.shape[0]).clamp_min(1.0)


def map_divergence(maps: WordMaps, alphas: torch.Tensor) -> torch.Tensor:
    """KL(m_{y_t} || alpha_t) of each word (B, T), 0 where the target names nothing: the
    maps ``alphas`` (B, T, L) pay for missing the cells the localiser finds the word in."""
    target = maps.log_maps.exp()
    log_alpha = torch.log(alphas.float().clamp_min(1e-12))
    divergence = (target * (maps.log_maps - log_alpha)).sum(dim=2)  # (B, T)
    return divergence * maps.words.float()


class ExpectedWordScore(nn.Module):
    """An attention score that looks where the words the decoder expects to say next are
    found (``model.word_attention``): the attention's own score plus the localiser's scores
    of those words, weighted by how much the decoder expects each,

        e_tl = score(a_l, h) + r sum_w q(w | h) s_lw,    q = softmax(W_e h),

    so that alpha_t is proportional to exp(score) times prod_w m_w^q(w): with one word
    expected, the attention's own map times that word's localiser map. The localiser's
    weights enter detached (only its own loss trains it); W_e learns from the captions and
    the map term, and with ``train.expected_word_weight`` from the next word's
    cross-entropy read from the (detached) query, so that it names the coming word. The
    localiser is held without registering it a second time (the captioner holds it), so
    every weight has one name in a checkpoint.

    With ``model.word_attention_words=categories`` only the words that name a category
    enter the sum (q is not renormalised): the maps of words no place in the photo shows
    ("a", "is", "on": present in nearly every photo, so their maps say nothing) no longer
    blur the named object's, and a decoder unsure whether an object comes next keeps its
    own map.

    Args:
        score: the attention's own score (keys of size A).
        localiser: the captioner's :class:`WordLocaliser`.
        query_dim: the decoder state size.
        vocab_size: V.
        restricted: hold a mask of the words that enter the sum (set by :meth:`look_at`,
            saved with the weights); False: every word does.
    """

    def __init__(
        self,
        score: nn.Module,
        localiser: WordLocaliser,
        query_dim: int,
        vocab_size: int,
        restricted: bool = False,
    ) -> None:
        super().__init__()
        self.score = score
        self.held = (localiser,)  # a tuple: not a second registration
        self.expect = Linear(query_dim, vocab_size)
        self.register_buffer("looked", torch.ones(vocab_size) if restricted else None)
        self._kept: tuple[tuple, torch.Tensor] | None = None  # see _class_weights

    def look_at(self, words: torch.Tensor) -> None:
        """Let only the words where ``words`` (V,) is true enter the expected-word sum."""
        if self.looked is None:
            raise ValueError("the score was built to look at every word (restricted=False)")
        if words.shape != self.looked.shape:
            raise ValueError(f"a mask over {self.looked.numel()} words, got {tuple(words.shape)}")
        self.looked.copy_(words.float())

    @property
    def localiser(self) -> WordLocaliser:
        return self.held[0]

    def _class_weights(self) -> torch.Tensor:
        """u of each word's class (V, R), detached, in fp32. Without gradients (decoding,
        which asks at every word) it is kept until the localiser's weights or classes
        change, in the dtype autocast would cast it to: gathering and casting it cost a
        tenth of a beam search's step."""
        localiser = self.localiser
        if torch.is_grad_enabled():
            return localiser.class_weights().detach().float()
        weight, classes = localiser.words.weight, localiser.classes
        device = weight.device.type
        dtype = torch.float32
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        key = (weight.data_ptr(), weight._version, weight.device, dtype)
        if classes is not None:
            key += (classes.data_ptr(), classes._version)
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, localiser.class_weights().detach().float().to(dtype))
        return self._kept[1]

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        """The own score's keys (B, L, A), then the localiser's projected cells (B, L, R)."""
        own = self.score.project_keys(features)
        cells = self.localiser.project(features).detach()
        return torch.cat([own, cells.to(own.dtype)], dim=-1)

    def forward(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, L, A + R), ``query`` (B*G, Q) → scores (B*G, L)."""
        rank = self.localiser.project.out_features
        own, cells = keys[..., :-rank], keys[..., -rank:]
        batch, count, _ = cells.shape
        expected = torch.softmax(self.expect(query).float(), dim=-1)  # (B*G, V)
        if self.looked is not None:
            expected = expected * self.looked
        word = expected @ self._class_weights()  # (B*G, R)
        word = word.view(batch, -1, rank)  # (B, G, R)
        prior = torch.bmm(word, cells.float().transpose(1, 2))  # (B, G, L)
        scores = self.score(own, query).float()
        return scores + self.localiser.sharpness * prior.reshape(scores.shape)


def category_classes(words: list[str], categories: dict[str, str]) -> torch.Tensor:
    """Each word id's class (V,) when the words naming one category share it: the lowest id
    among the vocabulary's ``words`` that ``categories`` (word: category) maps to the same
    category; a word that names none is its own class."""
    first: dict[str, int] = {}
    classes = torch.arange(len(words))
    for i, word in enumerate(words):
        category = categories.get(word)
        if category is None or i in SPECIAL_IDS:
            continue
        classes[i] = first.setdefault(category, i)
    return classes


def category_words_mask(words: list[str], categories: dict[str, str]) -> torch.Tensor:
    """(V,) bool: the vocabulary's ``words`` that ``categories`` maps to a category (never a
    special token)."""
    return torch.tensor(
        [i not in SPECIAL_IDS and categories.get(w) is not None for i, w in enumerate(words)]
    )
