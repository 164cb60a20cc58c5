"""Typed configuration for a whole run.

Defaults live here and nowhere else. A YAML file holds only what differs from them, and
``--set a.b=c`` overrides single keys on top. Unknown keys and wrong types are errors that
name the key (and the closest valid one). The resolved config travels with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from captioning.errors import ConfigError
from captioning.files import open_unlinked


@dataclass
class DataConfig:
    """Where the data is and how it is read.

    Paths are relative to ``root`` unless absolute. ``{split}`` in a pattern is replaced by
    the split's name in ``splits`` (for COCO 2014: ``train2014``/``val2014``).
    """

    format: Literal["coco", "karpathy"] = "coco"
    root: str = "data/shapes"
    # coco format: one captions file (and optionally one instances file) per split
    captions: str = "annotations/captions_{split}.json"
    instances: str | None = "annotations/instances_{split}.json"
    images: str = "images/{split}"
    splits: dict[str, str] = field(
        default_factory=lambda: {"train": "train", "val": "val", "test": "test"}
    )
    # karpathy format: one split file; images at {root}/{images}/{filepath}/{filename}
    karpathy_file: str = "dataset_coco.json"
    restval: bool = True
    # subsets, seeded and stable: an int applies to every split, a dict to the named splits
    max_images: int | dict[str, int] | None = None
    categories: list[str] = field(default_factory=list)
    subset_seed: int = 0
    # the captions' language (a BCP 47 tag such as en, vi); METEOR, whose stemmer and
    # paraphrase tables are English, is computed only for English
    language: str = "en"
    # vocabulary (built from the training split only)
    min_count: int = 1
    max_vocab: int | None = None
    # longer captions are cut to this many words when training (and the cut ones counted)
    max_caption_length: int | None = 50
    # loading
    on_bad_image: Literal["error", "skip"] = "error"
    # images with more pixels are bad images, refused before decoding (see data/images.py)
    max_image_pixels: int = 64_000_000
    max_image_text_bytes: int = 1 << 20  # one PNG text/ICC chunk, decompressed
    check_images: bool = True
    cache_images: bool = False
    num_workers: int = 0
    bucket_by_length: bool = False
    # cached grids of a frozen encoder (captioning extract-features), relative to root;
    # null never reads a cache
    feature_cache: str | None = "features"


@dataclass
class ModelConfig:
    """Encoder, attention and decoder. Paper settings are the defaults."""

    # encoder
    encoder: str = "vgg19"  # small_cnn, vgg19, resnet50, resnet101, resnet152, ...
    weights: str | None = None  # torchvision weights name (IMAGENET1K_V1), a file, or none
    image_size: int = 224
    grid_size: int | None = None  # adaptive pooling to grid_size x grid_size; None keeps it
    fine_tune: str = "none"  # none | all | last_N (the last N stages)
    # Leave out the backbone's last N stages. MobileNetV2's last is its 1 x 1 convolution
    # to 1,280 channels, made for the classifier's global pooling; with 1 the grid is the
    # 320 channels of its last inverted-residual block, at the same resolution.
    drop_stages: int = 0
    # A two-level encoder: "where" from the grid, "what" from the backbone's whole depth.
    # With a summary, the stages that drop_stages leaves out still run, on the grid, and
    # their output pooled to one vector per image (MobileNetV2's 1,280 channels) goes to the
    # initial state (init), to the deep output beside the attended context (output), or both;
    # the grid the decoder attends over stays the earlier stage's (docs/grounding.md).
    summary: Literal["none", "init", "output", "both"] = "none"
    # At the deep output the summary's term is a constant of the caption; with a gate it is
    # scaled at each word by sigmoid(w^T h_t + b) of its own, as the paper's beta scales the
    # attended context, so that the words it does not help can turn it down
    # (model.summary: output or both).
    summary_gate: bool = False
    # Hypercolumns (Hariharan et al. 2015): each cell of the grid drop_stages leaves also
    # carries the stages it leaves out, run on the grid and their output upsampled
    # bilinearly to it, joined to the cell's channels: a fine grid that says where and what
    # (MobileNetV2, drop_stages 5: 14 x 14 cells of 96 + 1,280 channels at 224 px).
    hypercolumn: bool = False
    # Halve the backbone's output stride (32 → 16, DeepLab's "atrous" trick): the last
    # downsampling convolution keeps its input's resolution and the convolutions after it
    # are dilated by 2, so the same weights give a grid twice as fine (14 x 14 at 224 px for
    # MobileNetV2 and ResNets, the paper's grid size) of the same late, semantic features.
    # null keeps the backbone's own stride.
    output_stride: int | None = None
    # Local cells: cut the photo into tiles x tiles cells and run the backbone on each
    # cell's window alone (a square of tile_size px centred on the cell; past the photo's
    # edge, the mean colour), its output averaged into the cell's vector. A backbone's own
    # grid has cells that have each seen most of the photo; these see their own part only,
    # as region features do. null: the backbone's own grid. tile_size null: twice a cell.
    tiles: int | None = None
    tile_size: int | None = None
    positional: Literal["none", "learned", "sinusoidal"] = "none"
    cnn_channels: list[int] = field(default_factory=lambda: [32, 64, 128, 128])
    # the small CNN's blocks: preact (an identity shortcut), residual (a learnt projection
    # where the channels change) or plain conv-BN-ReLU, which loses the colours on some seeds
    # (docs/attention.md) and rebuilds the blocks of older checkpoints
    cnn_block: Literal["plain", "residual", "preact"] = "preact"
    # Self-attention over the grid: N pre-norm Transformer encoder layers over the L cells,
    # after the position codes (and after the feature cache), so a cell can carry its
    # relations to the others ("left of", "the middle one") to the decoder.
    grid_layers: int = 0
    grid_heads: int = 4
    # attention
    # soft, hard, none, or local: soft attention times a Gaussian around a centre the
    # decoder predicts (Luong's local-p on the 2-D grid), local_sigma cells wide; or a name
    # given to captioning.models.attention.register_attention
    attention: str = "soft"
    local_sigma: float = 1.0
    # alpha = softmax(score / attention_temperature): below 1 a sharper map for the same
    # scores; the score's last layer could learn the same scale, but under Adam it moves by
    # the same step at any scale, so a temperature starts and trains the map as if that
    # layer's weights and learning rate were 1 / temperature times larger (soft, hard, local
    # and each head; an attention given to register_attention reads it from its config)
    attention_temperature: float = 1.0
    # additive, additive_relu, dot, general, scaled_dot, cosine, or location (W h: where,
    # not what; Luong 2015)
    score: str = "additive"
    attention_dim: int = 512
    # what the context averages: the features themselves (the paper), or values W_v a_i of
    # size value_dim, a projection of their own beside the score's keys (key-value attention)
    values: Literal["features", "projected"] = "features"
    value_dim: int = 512
    heads: int = 1  # > 1: soft multi-head attention; each head averages 1/heads of the channels
    # decoder
    embed_dim: int = 512
    hidden_dim: int = 1024
    gate: Literal["scalar", "vector", "none"] = "scalar"
    deep_output: bool = True
    # The paper feeds the context z_t into the LSTM; false keeps it in the output layer only,
    # so the LSTM never stores what it saw and each word must come from its own glimpse.
    context_to_lstm: bool = True
    # what the attention asks with: ``previous`` (the paper: h_{t-1}, the state before the
    # previous word is read) or ``current`` (h_t, after the LSTM has read the previous word,
    # so the query knows the word it follows; model.context_to_lstm: false only, since
    # with the context in the LSTM h_t needs the glimpse it would choose)
    query: Literal["previous", "current"] = "previous"
    # h_0, c_0 from the image (tanh or linear of the mean cell, or of the summary when it
    # goes to init) or learned (one trained pair for every image: the decoder knows nothing
    # of the image before its first glimpse)
    init_state: Literal["tanh", "linear", "learned"] = "tanh"
    dropout: float = 0.5
    # a linear layer from each word's attended context (before the gate) to the vocabulary,
    # trained by train.context_word_weight: the word must be readable from where it looked
    # (captions never read it: a model without it, a hard stage say, may --init from one with it)
    context_words: bool = False
    # a word localiser trained beside the decoder on the captions' words alone (each word's
    # per-cell score, log-sum-exp pooled into whether the word is in the caption): its maps
    # say where each word is, and train.word_map_weight draws the attention toward them
    # (captioning/models/word_maps.py; captions never use it)
    word_maps: bool = False
    word_map_rank: int = 256  # the localiser's shared projection of the cells
    # r of the localiser's log-sum-exp pooling and of its maps softmax(r s): near 0 it pools
    # by the mean (every cell answers for the word), large r by the maximum (the single most
    # telling cell does)
    word_map_sharpness: float = 5.0
    # the localiser's classes: "words", one per word; "categories", the words that name one
    # category (through the shipped map of words to COCO categories, with
    # model.word_map_categories' entries over it) share one score, label and map, so that it
    # learns where the category is rather than which of its words a caption chose
    word_map_classes: Literal["words", "categories"] = "words"
    # a JSON or YAML file of word: category entries over the shipped map (a word mapped to
    # null is dropped), for model.word_map_classes=categories
    word_map_categories: str | None = None
    # the attention's score adds the localiser's scores of the words the decoder expects to
    # say next (softmax(W_e h) over the vocabulary): it looks where those words are found
    # (soft attention's map, or the distribution hard attention samples its cells from)
    word_attention: bool = False
    # the words whose localiser scores model.word_attention adds: "all", or "categories",
    # only those that name a category (model.word_map_classes=categories), so that the maps
    # of words no place shows ("a", "is", "on") do not blur the named object's
    word_attention_words: Literal["all", "categories"] = "all"


@dataclass
class TrainConfig:
    """Optimisation, schedule, model selection and logging."""

    epochs: int = 20
    batch_size: int = 64
    lr: float = 4e-4
    encoder_lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 5.0
    schedule: Literal["plateau", "step", "cosine", "none"] = "plateau"
    lr_factor: float = 0.5
    lr_patience: int = 2
    lr_step: int = 10
    warmup_steps: int = 0  # linear warm-up, with the cosine schedule
    early_stop_patience: int = 5  # validations without improvement; 0 turns it off
    select_metric: Literal["CIDEr", "Bleu_4", "exact_match"] = "CIDEr"
    val_max_images: int | None = None  # decode only this many validation images per epoch
    # validate (and pick best.pt) after every N-th epoch and after the last; the epochs between
    # only train, which saves validation's decoding and scoring on short schedules
    val_every: int = 1
    # the first epoch that may validate: the epochs before it only train (a schedule that
    # decays to its end picks its best.pt among its last epochs; their scores do not move)
    val_from: int = 1
    doubly_stochastic_weight: float = 1.0  # λ of the doubly stochastic attention penalty
    # w of the soft attention maps' entropy (nats, summed over a caption's words) added to the
    # cross-entropy: above 0 each word pays for spreading its map (docs/grounding.md)
    attention_entropy_weight: float = 0.0
    # w of the cross-entropy of each word predicted from its attended context alone (by
    # model.context_words' layer), summed over a caption's words: above 0 a word's map is
    # paid for falling where its word can be read (docs/grounding.md)
    context_word_weight: float = 0.0
    # w of KL(m_y || alpha_t), from the localiser's map of each word (model.word_maps) to
    # the word's attention map, summed over a caption's words: above 0 each word's map is
    # drawn toward the cells where its word is found (docs/grounding.md)
    word_map_weight: float = 0.0
    # the words the localiser (model.word_maps) is told are in each caption's image:
    # "caption", the caption's own; "image", those of every reference caption of the image
    # (the grid probe's labels: a word another reference names is not a negative)
    word_map_labels: Literal["caption", "image"] = "caption"
    # v of the cross-entropy of each next word read from the decoder state that the
    # attention's query is (by model.word_attention's expected-word layer), summed over a
    # caption's words: above 0 that layer learns which word comes next, so the attention
    # looks where the localiser finds it (the state itself is not moved; docs/grounding.md)
    expected_word_weight: float = 0.0
    # cross-entropy objective only: the share of each target's probability spread evenly
    # over the vocabulary (Szegedy et al. 2016); 0 trains on the plain likelihood
    label_smoothing: float = 0.0
    # hard attention (REINFORCE); the authors' values
    reinforce_weight: float = 0.1
    entropy_weight: float = 0.002
    baseline_decay: float = 0.9
    semi_sampling_p: float = 0.5  # share of minibatches (or captions) that sample cells
    semi_sampling: Literal["batch", "sample"] = "batch"  # the authors mix per minibatch
    # how hard attention's gradient is estimated (see captioning/objectives/hard_attention.py and
    # docs/hard-attention.md): the paper's REINFORCE with a moving-average baseline, leave-one-out
    # REINFORCE or VIMCO over hard_samples samples per caption, straight-through
    # Gumbel-softmax, or the exact marginal likelihood (model.context_to_lstm: false only)
    hard_estimator: Literal["reinforce", "reinforce_loo", "vimco", "gumbel", "exact"] = "reinforce"
    hard_samples: int = 4  # K, the samples per caption of reinforce_loo and vimco
    # exact: the share of minibatches trained with the expected (soft) context instead of
    # the marginal, by a coin seeded like the paper's mixing coin; 0: none
    exact_soft_p: float = 0.0
    gumbel_temperature: float = 1.0  # the starting temperature of the relaxation
    gumbel_min_temperature: float = 0.5
    gumbel_anneal_rate: float = 1e-4  # temperature *= exp(-rate) after every step
    # what the model is trained to minimise (captioning/objectives/): xe, the references'
    # likelihood (cross-entropy, or hard attention's estimator), or scst, self-critical
    # sequence training: sampled captions rewarded with CIDEr-D against the training
    # references, minus a baseline (start it from a cross-entropy checkpoint with
    # `captioning train --init CKPT`); or a name given to register_objective
    objective: str = "xe"
    # greedy: the reward of the greedy caption (Rennie et al. 2017); loo: each sample's
    # baseline is the mean reward of the other samples of its image
    scst_baseline: Literal["greedy", "loo"] = "greedy"
    scst_samples: int = 5  # K, the captions sampled per image
    scst_bleu_weight: float = 0.0  # reward = CIDEr-D + w * BLEU-4
    scst_temperature: float = 1.0  # the sampling temperature
    scst_max_length: int | None = None  # words per sampled caption; None: decode.max_length
    # numerics and bookkeeping
    # auto: bf16 where the device computes it natively (CUDA, AVX-512 BF16 or AMX CPUs), else
    # fp32; training resolves it once and records the result in config.yaml and checkpoints
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    device: str = "auto"  # auto, cpu, cuda, cuda:1, ...
    threads: int | None = None  # torch.set_num_threads on CPU; None keeps torch's choice
    seed: int = 0
    stop_on_nonfinite: bool = True
    log_every: int = 50
    figure_every_epoch: bool = True
    quiet: bool = False


@dataclass
class DecodeConfig:
    """How captions are generated at validation and test time."""

    strategy: Literal["greedy", "beam", "sample"] = "greedy"
    beam_size: int = 3
    max_length: int = 20
    min_length: int = 1
    length_penalty: float = 0.0  # GNMT alpha; 0 turns it off
    # <unk> stands for every word the vocabulary left out: a caption that says it tells the
    # reader nothing, so decoding never chooses it; true allows it (for studies of the
    # vocabulary)
    allow_unk: bool = False
    temperature: float = 1.0
    top_k: int = 0
    # how a hard-attention model forms its context when decoding: the expected context (as
    # the authors decode), the most likely cell's feature, a sampled cell's, or (with
    # model.context_to_lstm: false) the exact marginal of the next word over the cells
    hard_context: Literal["expectation", "argmax", "sample", "marginal"] = "expectation"


@dataclass
class RuntimeConfig:
    """How a trained model runs: the numerics of captioning (validation, ``evaluate``,
    ``caption``, the Python API and the web demo) and speed switches that change no number.
    Nothing here changes a weight, so a resumed run may change any of it. A null key takes
    the ``train`` section's value when the config is made (so a checkpoint written before
    this section existed decodes as it did), and is stored resolved."""

    # autocast precision of encoding and decoding; null: train.precision, the precision the
    # model was trained in (as training resolved auto)
    precision: Literal["fp32", "bf16", "fp16", "auto"] | None = None
    batch_size: int | None = None  # images decoded at once; null: train.batch_size
    # the seed of sampled decoding in evaluate (decode.strategy=sample,
    # decode.hard_context=sample); null: train.seed
    seed: int | None = None
    # the encoder's convolutions on channels-last (NHWC) tensors, which oneDNN on the CPU
    # and cuDNN with tensor cores prefer (the small CNN: about 15% less time on the CPU);
    # the same grid either way
    channels_last: bool = True
    # with model.context_to_lstm=false, teacher forcing runs all words at once (the same
    # numbers as the step loop to 1e-5); false forces the step loop
    parallel_decoder: bool = True


# The runtime keys whose null means "as in the train section".
RUNTIME_FROM_TRAIN = ("precision", "batch_size", "seed")


@dataclass
class Config:
    """The whole run: ``data``, ``model``, ``train``, ``decode`` and ``runtime`` sections."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        # The one place a runtime setting follows training's: every Config is made here.
        missing = {
            key: getattr(self.train, key)
            for key in RUNTIME_FROM_TRAIN
            if getattr(self.runtime, key) is None
        }
        if missing:
            self.runtime = dataclasses.replace(self.runtime, **missing)


# --------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Union:  # Optional[Literal[...]] has no useful name
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where it is lossless."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {quote(value)}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key} must be one of {_type_name(tp)}, got {quote(value)}{hint}")
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {quote(value)}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {quote(value)}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {quote(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {quote(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {quote(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {quote(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} must be null, got {quote(value)}")
    raise ConfigError(f"{key}: unsupported type {tp}")


# Keys that were renamed: old dotted name → new one. Files and overrides that use an old name
# get an error that names the new one; checkpoints written before are upgraded on load.
RENAMED_KEYS = {
    "train.doubly_stochastic": "train.doubly_stochastic_weight",
    "decode.hard_decode": "decode.hard_context",
}


# Keys that were replaced by another of different meaning: old dotted name → what to use.
# Files and overrides that use one get an error that says so; checkpoints written before lose
# the key on load (and take the new key's default).
RETIRED_KEYS = {
    "decode.suppress_unk": "decode.allow_unk (false by default: <unk> is never chosen)",
    "model.cnn_residual": "model.cnn_block (plain, residual or preact; false was plain)",
}


def rename_legacy_keys(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a nested config dict with every renamed key under its new name and every
    retired key left out (for configs stored in old checkpoints)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for old in RETIRED_KEYS:
        section, key = old.split(".")
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    for old, new in RENAMED_KEYS.items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        section = out.get(old_section)
        if isinstance(section, dict) and old_key in section:
            out.setdefault(new_section, {})[new_key] = section.pop(old_key)
    return out


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    key = key if len(key) <= 60 else key[:57] + "..."
    full = f"{prefix}{key}" if key.isprintable() else f"{prefix}{quote(key)}"  # one line
    if full in RENAMED_KEYS:
        return ConfigError(f"config key {full} was renamed to {RENAMED_KEYS[full]}; use that name")
    if full in RETIRED_KEYS:
        return ConfigError(f"config key {full} was replaced by {RETIRED_KEYS[full]}; use that")
    if not prefix:  # a bare `epochs=3` most likely meant a key inside a section
        valid = valid + [
            f"{section.name}.{f.name}"
            for section in dataclasses.fields(Config)
            for f in dataclasses.fields(section.default_factory())
        ]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {full}{hint}")


def _merge(obj: Any, updates: dict[str, Any], prefix: str = "") -> Any:
    """A copy of dataclass ``obj`` with ``updates`` (a nested dict) applied and checked."""
    if not isinstance(updates, dict):
        raise ConfigError(f"config section {prefix.rstrip('.') or '<top>'} must be a mapping")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    changes = {}
    for key, value in updates.items():
        if key not in hints:
            raise _unknown_key(str(key), names, prefix)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            changes[key] = _merge(current, value, f"{prefix}{key}.")
        else:
            changes[key] = _coerce(value, hints[key], f"{prefix}{key}")
    return dataclasses.replace(obj, **changes)


def _validate(cfg: Config) -> None:
    if not re.fullmatch(r"none|all|last_[1-9][0-9]*", cfg.model.fine_tune):
        raise ConfigError(
            f"model.fine_tune must be none, all or last_N (e.g. last_2), "
            f"got {quote(cfg.model.fine_tune)}"
        )
    _check_ranges(cfg)
    if cfg.train.label_smoothing > 0 and (
        cfg.model.attention == "hard" or cfg.train.objective == "scst"
    ):
        raise ConfigError(
            "train.label_smoothing smooths the cross-entropy of soft (or no) attention; "
            "set it to 0 for hard attention and for train.objective=scst"
        )
    channels = cfg.model.cnn_channels
    if not channels:
        raise ConfigError("model.cnn_channels must list at least one channel count")
    if cfg.model.cnn_block == "preact" and any(b < a for a, b in zip(channels, channels[1:])):
        raise ConfigError(
            f"model.cnn_block=preact needs model.cnn_channels that never shrink, got "
            f"{channels}; widen the later entries or use model.cnn_block=residual"
        )
    if cfg.decode.min_length > cfg.decode.max_length:
        raise ConfigError(
            f"decode.min_length={cfg.decode.min_length} must not exceed "
            f"decode.max_length={cfg.decode.max_length}"
        )
    if not re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", cfg.train.device):
        raise ConfigError(
            f"train.device must be auto, cpu, cuda, cuda:N or mps, got {quote(cfg.train.device)}"
        )
    _validate_summary(cfg.model)
    _validate_tiles(cfg.model)
    _validate_context_words(cfg)
    if cfg.model.attention_temperature != 1 and cfg.model.attention == "none":
        raise ConfigError(
            f"model.attention_temperature={cfg.model.attention_temperature} scales attention "
            "scores; model.attention=none has none (use soft, hard or local, or leave it at 1)"
        )
    if cfg.model.values == "projected" and cfg.model.attention == "none":
        raise ConfigError(
            "model.values=projected averages values by attention weights; "
            "model.attention=none has none (use soft or hard)"
        )
    _validate_hard_estimator(cfg)
    if cfg.train.scst_baseline == "loo" and cfg.train.scst_samples < 2:
        raise ConfigError(
            "train.scst_baseline=loo compares each sample with the others of its image: "
            f"train.scst_samples must be at least 2, got {cfg.train.scst_samples}"
        )
    if not (cfg.model.context_to_lstm or cfg.model.deep_output):
        raise ConfigError(
            "model.context_to_lstm=false needs model.deep_output=true, "
            "or the context reaches nothing"
        )
    if cfg.model.query == "current" and cfg.model.context_to_lstm:
        raise ConfigError(
            "model.query=current asks with h_t, which the context fed to the LSTM would need "
            "before it exists: set model.context_to_lstm=false (or model.query=previous)"
        )
    if set(cfg.data.splits) - {"train", "val", "test"}:
        extra = sorted(set(cfg.data.splits) - {"train", "val", "test"})
        raise ConfigError(f"data.splits keys must be train, val, test; got {extra}")


def _validate_context_words(cfg: Config) -> None:
    """The context-word term's settings that cannot work together."""
    model, weight = cfg.model, cfg.train.context_word_weight
    if model.context_words and model.attention in ("hard", "none"):
        raise ConfigError(
            f"model.context_words reads each word from its attended context, which "
            f"model.attention={model.attention} does not average by a map it can train: "
            f"use soft or local attention, or set model.context_words=false"
        )
    if weight > 0 and not model.context_words:
        raise ConfigError(
            f"train.context_word_weight={weight} needs the layer that reads the word from "
            f"its context: set model.context_words=true (or the weight to 0)"
        )
    if weight > 0 and cfg.train.objective != "xe":
        raise ConfigError(
            "train.context_word_weight adds to the cross-entropy objective; set it to 0 "
            "for train.objective=scst"
        )
    _validate_word_maps(cfg)


def _validate_word_maps(cfg: Config) -> None:
    """The word localiser's settings that cannot work together."""
    model, weight = cfg.model, cfg.train.word_map_weight
    if model.word_maps and model.attention == "none":
        raise ConfigError(
            "model.word_maps trains a localiser toward whose maps the attention is drawn, "
            "and model.attention=none has no map to draw: use soft, local or hard "
            "attention, or set model.word_maps=false"
        )
    if model.word_map_classes != "words" and not model.word_maps:
        raise ConfigError(
            f"model.word_map_classes={model.word_map_classes} groups the word localiser's "
            "classes: set model.word_maps=true (or model.word_map_classes=words)"
        )
    if model.word_map_categories is not None and model.word_map_classes != "categories":
        raise ConfigError(
            "model.word_map_categories maps words to the localiser's categories: set "
            "model.word_map_classes=categories (or leave the file out)"
        )
    if model.word_attention_words != "all" and (
        not model.word_attention or model.word_map_classes != "categories"
    ):
        raise ConfigError(
            f"model.word_attention_words={model.word_attention_words} picks the words the "
            "expected-word score looks by: set model.word_attention=true and "
            "model.word_map_classes=categories (or model.word_attention_words=all)"
        )
    if model.word_attention and not model.word_maps:
        raise ConfigError(
            "model.word_attention looks where the localiser finds the expected words: set "
            "model.word_maps=true (or model.word_attention=false)"
        )
    if model.word_attention and (model.attention not in ("soft", "hard") or model.heads > 1):
        raise ConfigError(
            f"model.word_attention adds to one soft or hard attention's score; "
            f"model.attention={model.attention} with model.heads={model.heads} has another: "
            f"use model.attention=soft or hard and model.heads=1"
        )
    if weight > 0 and not model.word_maps:
        raise ConfigError(
            f"train.word_map_weight={weight} needs the word localiser whose maps it draws "
            f"toward: set model.word_maps=true (or the weight to 0)"
        )
    if cfg.train.word_map_labels != "caption" and not model.word_maps:
        raise ConfigError(
            f"train.word_map_labels={cfg.train.word_map_labels} labels the word localiser's "
            f"training: set model.word_maps=true (or train.word_map_labels=caption)"
        )
    sharpness = model.word_map_sharpness
    if sharpness != ModelConfig.word_map_sharpness and not model.word_maps:
        raise ConfigError(
            f"model.word_map_sharpness={sharpness} is the word localiser's pooling: set "
            f"model.word_maps=true (or leave the sharpness at {ModelConfig.word_map_sharpness})"
        )
    expected = cfg.train.expected_word_weight
    if expected > 0 and not model.word_attention:
        raise ConfigError(
            f"train.expected_word_weight={expected} trains model.word_attention's "
            f"expected-word layer: set model.word_attention=true (or the weight to 0)"
        )
    if model.word_maps and cfg.train.objective != "xe":
        raise ConfigError(
            "model.word_maps trains beside the cross-entropy objective; set it to false "
            "for train.objective=scst"
        )


def _validate_summary(model: ModelConfig) -> None:
    """The summary's settings that cannot work together."""
    if model.summary in ("init", "both") and model.init_state == "learned":
        raise ConfigError(
            f"model.summary={model.summary} computes the initial state from the image, "
            f"model.init_state=learned keeps it from the image: set model.summary=output "
            f"(or none), or model.init_state=tanh"
        )
    if model.summary_gate and model.summary not in ("output", "both"):
        raise ConfigError(
            f"model.summary_gate gates the summary at the deep output, and "
            f"model.summary={model.summary} sends none there: set model.summary=output or "
            f"both, or model.summary_gate=false"
        )
    if model.summary in ("output", "both") and not model.deep_output:
        raise ConfigError(
            f"model.summary={model.summary} adds the summary to the deep output: set "
            f"model.deep_output=true, or model.summary=init"
        )
    if model.summary != "none" and model.encoder == "small_cnn":
        raise ConfigError(
            "model.summary pools a pretrained backbone's later stages; the small CNN has "
            "none to spare (set model.summary=none)"
        )
    if model.hypercolumn and (model.tiles or not model.drop_stages):
        raise ConfigError(
            "model.hypercolumn joins the stages model.drop_stages leaves out to the backbone's "
            "own grid: set model.drop_stages to 1 or more, and model.tiles to null"
        )
    if model.summary != "none" and model.grid_layers:
        raise ConfigError(
            "model.summary and model.grid_layers do not combine yet: set one of them off"
        )


def _validate_tiles(model: ModelConfig) -> None:
    """The tiled grid's settings that cannot work together."""
    if model.tiles is None:
        if model.tile_size is not None:
            raise ConfigError("model.tile_size is the window of model.tiles: set model.tiles too")
        return
    if model.grid_size is not None:
        raise ConfigError(
            "model.tiles makes the grid (tiles x tiles cells); model.grid_size would pool it "
            "again: set model.grid_size=null"
        )
    cell = -(-model.image_size // model.tiles)
    if model.tile_size is not None and model.tile_size < cell:
        raise ConfigError(
            f"model.tile_size={model.tile_size} is smaller than a cell ({model.image_size} px "
            f"/ {model.tiles} tiles = {cell} px): the windows would leave parts of the photo "
            f"unseen; set at least {cell}"
        )


def unknown_choice(key: str, value: Any, known: typing.Iterable[str], register: str) -> ConfigError:
    """The error for a name that no registry holds (an attention, score, objective or
    encoder): the names it knows, the nearest of them, and the function that adds one."""
    names = sorted(known)
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"{key} must be one of {', '.join(names)}, got {quote(value)}{hint}; "
        f"{register} adds another"
    )


# The range of every numeric key, checked in one place: key → (minimum, maximum, which ends
# are open). None leaves that side unbounded; a key whose value is null is not checked.
_RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "data.max_images": (1, None, ""),
    "data.min_count": (1, None, ""),
    "data.max_vocab": (1, None, ""),
    "data.max_caption_length": (1, None, ""),
    "data.num_workers": (0, None, ""),
    "data.max_image_pixels": (1, None, ""),
    "data.max_image_text_bytes": (1, None, ""),
    "model.image_size": (1, None, ""),
    "model.grid_size": (1, None, ""),
    "model.cnn_channels": (1, None, ""),
    "model.attention_dim": (1, None, ""),
    "model.value_dim": (1, None, ""),
    "model.heads": (1, None, ""),
    "model.local_sigma": (0, None, "min"),
    "model.attention_temperature": (0, None, "min"),
    "model.embed_dim": (1, None, ""),
    "model.hidden_dim": (1, None, ""),
    "model.dropout": (0, 1, "max"),
    "model.grid_layers": (0, None, ""),
    "model.drop_stages": (0, None, ""),
    "model.output_stride": (1, None, ""),
    "model.tiles": (1, None, ""),
    "model.tile_size": (1, None, ""),
    "model.grid_heads": (1, None, ""),
    "train.epochs": (1, None, ""),
    "train.batch_size": (1, None, ""),
    "train.lr": (0, None, "min"),
    "train.encoder_lr": (0, None, ""),
    "train.weight_decay": (0, None, ""),
    "train.grad_clip": (0, None, ""),
    "train.lr_factor": (0, 1, "min max"),
    "train.lr_patience": (0, None, ""),
    "train.lr_step": (1, None, ""),
    "train.warmup_steps": (0, None, ""),
    "train.early_stop_patience": (0, None, ""),
    "train.val_every": (1, None, ""),
    "train.val_from": (1, None, ""),
    "train.val_max_images": (1, None, ""),
    "train.doubly_stochastic_weight": (0, None, ""),
    "train.attention_entropy_weight": (0, None, ""),
    "train.context_word_weight": (0, None, ""),
    "train.word_map_weight": (0, None, ""),
    "train.expected_word_weight": (0, None, ""),
    "model.word_map_rank": (1, None, ""),
    "model.word_map_sharpness": (0, None, "min"),
    "train.label_smoothing": (0, 1, "max"),
    "train.reinforce_weight": (0, None, ""),
    "train.entropy_weight": (0, None, ""),
    "train.baseline_decay": (0, 1, ""),
    "train.semi_sampling_p": (0, 1, ""),
    "train.hard_samples": (1, None, ""),
    "train.exact_soft_p": (0, 1, ""),
    "train.gumbel_temperature": (0, None, "min"),
    "train.gumbel_min_temperature": (0, None, "min"),
    "train.gumbel_anneal_rate": (0, None, ""),
    "train.scst_samples": (1, None, ""),
    "train.scst_bleu_weight": (0, None, ""),
    "train.scst_temperature": (0, None, "min"),
    "train.scst_max_length": (1, None, ""),
    "train.threads": (1, None, ""),
    "train.seed": (0, 2**63 - 1, ""),
    "train.log_every": (1, None, ""),
    "decode.beam_size": (1, 64, ""),  # beams past 64 only hold more memory
    "decode.max_length": (1, None, ""),
    "decode.min_length": (0, None, ""),
    "decode.length_penalty": (0, None, ""),
    "decode.temperature": (0, None, "min"),
    "decode.top_k": (0, None, ""),
    "runtime.batch_size": (1, None, ""),
    "runtime.seed": (0, 2**63 - 1, ""),
}


def _check_ranges(cfg: Config) -> None:
    """Refuse a numeric value outside its range in :data:`_RANGES` (lists and mappings of
    numbers are checked value by value)."""
    for key, (low, high, open_ends) in _RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        items = value.values() if isinstance(value, dict) else value
        for item in items if isinstance(value, dict | list) else [value]:
            if item is None or isinstance(item, bool) or not isinstance(item, int | float):
                continue
            too_low = low is not None and (item <= low if "min" in open_ends else item < low)
            too_high = high is not None and (item >= high if "max" in open_ends else item > high)
            if too_low or too_high or item != item:  # NaN is in no range
                raise ConfigError(
                    f"{key} must be {_describe_range(low, high, open_ends)}, got {quote(value)}"
                )


def _describe_range(low: float | None, high: float | None, open_ends: str) -> str:
    if high is None:
        return f"{'more than' if 'min' in open_ends else 'at least'} {low}"
    left, right = "(" if "min" in open_ends else "[", ")" if "max" in open_ends else "]"
    return f"in {left}{low}, {high}{right}"


_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = 6
_QUOTE.maxlevel = 3


def quote(value: Any) -> str:
    """``repr(value)``, bounded: an error message may quote anything a config holds, and a
    YAML alias bomb must not turn into a line of hundreds of megabytes."""
    return _QUOTE.repr(value)


def _validate_hard_estimator(cfg: Config) -> None:
    """Refuse hard-attention estimator settings that cannot work, with the reason."""
    train, name = cfg.train, cfg.train.hard_estimator
    if name != "reinforce" and cfg.model.attention != "hard":
        raise ConfigError(
            f"train.hard_estimator={name} trains hard attention; this model has "
            f"model.attention={cfg.model.attention}"
        )
    if name == "exact" and cfg.model.context_to_lstm:
        raise ConfigError(
            "train.hard_estimator=exact needs model.context_to_lstm=false: with the context "
            "fed to the LSTM, h_t depends on every earlier cell and the marginal has L^T terms"
        )
    if train.exact_soft_p > 0 and name != "exact":
        raise ConfigError(
            f"train.exact_soft_p={train.exact_soft_p} mixes the exact estimator's minibatches; "
            f"with train.hard_estimator={name} use train.semi_sampling_p (or set "
            f"train.exact_soft_p=0)"
        )
    if name in ("reinforce_loo", "vimco") and train.hard_samples < 2:
        raise ConfigError(
            f"train.hard_estimator={name} compares samples with each other: "
            f"train.hard_samples must be at least 2, got {train.hard_samples}"
        )
    if train.gumbel_min_temperature > train.gumbel_temperature:  # both > 0: see _RANGES
        raise ConfigError(
            "train.gumbel_temperature must be at least train.gumbel_min_temperature > 0; got "
            f"{train.gumbel_temperature} and {train.gumbel_min_temperature}"
        )
    if cfg.decode.hard_context == "marginal" and cfg.model.context_to_lstm:
        raise ConfigError(
            "decode.hard_context=marginal needs model.context_to_lstm=false: with the context "
            "in the LSTM the marginal over cells is not one sum per word"
        )


# --------------------------------------------------------------------------- public API


def config_from_dict(values: dict[str, Any]) -> Config:
    """A checked :class:`Config` from a nested dict (missing keys keep their defaults)."""
    base = Config()
    base.runtime = RuntimeConfig()  # unresolved: its nulls follow the merged train section
    cfg = _merge(base, values or {})
    _validate(cfg)
    return cfg


def replace_section(cfg: Config, section: str, **values: Any) -> Config:
    """A checked copy of ``cfg`` with keys of one section replaced (None values are skipped).

    >>> replace_section(cfg, "decode", strategy="beam", beam_size=5)
    """
    data = config_to_dict(cfg)
    data[section].update({k: v for k, v in values.items() if v is not None})
    return config_from_dict(data)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (YAML- and checkpoint-safe)."""
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key path and value.

    The value is read as YAML (``3``, ``true``, ``[dog, cat]``, ``null``), except for keys
    that hold strings, which take the text as written (``data.images={split}`` is a pattern).
    """
    if "=" not in text:
        raise ConfigError(f"override {quote(text)} must look like section.key=value")
    key, raw = (part.strip() for part in text.split("=", 1))
    path = key.split(".")
    if not key or any(not part for part in path):
        raise ConfigError(f"override {quote(text)} must look like section.key=value")
    if _field_type(path) in (str, str | None) and raw not in ("null", "~"):
        return path, raw
    try:
        value = yaml.safe_load(raw) if raw else ""
        _check_size(value, f"override {quote(text)}")
        return path, value
    except yaml.YAMLError as exc:
        first_line = str(exc).splitlines()[0][:200]
        raise ConfigError(
            f"override {quote(text)}: value is not valid YAML ({first_line})"
        ) from exc


def _field_type(path: list[str]) -> Any:
    """The annotation of the config key at ``path`` (None if there is no such key)."""
    node: Any = Config
    for part in path:
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
    return node


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return out


def _deep_update(base: dict[str, Any], updates: dict[str, Any]) -> None:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


BASE_KEY = "base"
# How deep a chain of bases may go (a recipe's stage rarely has more than two above it).
MAX_BASE_DEPTH = 16


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config file into a dict, with one-line errors.

    A file may name the configs it extends with a top-level ``base:``, one file or a list
    of them (paths relative to the file itself): each base is read (with its own bases, and
    so on), the list merged in order key by key, later over earlier, and the file's sections
    over them all. So a data set's base and a model's recipe combine without one extending
    the other, and a second stage names its first stage and the stage's block (e.g.
    ``base: [flickr8k_mobilenet.yaml, base_scst.yaml]``). A chain that comes back to a file
    is an error.
    """
    path = Path(path)
    values = _read_one_yaml(path)
    bases = values.pop(BASE_KEY, None)
    if bases is None:
        return values
    if isinstance(bases, str):
        bases = [bases]
    if (
        not isinstance(bases, list)
        or not bases
        or not all(isinstance(base, str) and base.strip() for base in bases)
    ):
        raise ConfigError(
            f"config file {path}: {BASE_KEY} must be the path of a config file or a list of "
            f"them, got {quote(bases)}"
        )
    chain = (*_chain, path.resolve())
    if len(chain) > MAX_BASE_DEPTH:
        raise ConfigError(f"config file {path}: more than {MAX_BASE_DEPTH} bases above it")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base).resolve()
        if base_path in chain:
            loop = " -> ".join(str(p) for p in (*chain, base_path))
            raise ConfigError(f"config file {path}: its bases come back to {base_path} ({loop})")
        if not base_path.is_file():
            raise ConfigError(
                f"config file {path}: its {BASE_KEY} {base} ({base_path}) does not exist"
            )
        _deep_update(merged, read_yaml(base_path, chain))
    _deep_update(merged, values)
    return merged


def _read_one_yaml(path: Path) -> dict[str, Any]:
    """One YAML config file as a dict (its ``base`` key unresolved)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_bytes())  # UTF-8, or UTF-16/32 with a byte-order mark
    except (UnicodeDecodeError, yaml.reader.ReaderError) as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 (or UTF-16 with a byte-order mark) text"
        ) from exc
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0][:200]
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from exc
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    _check_size(values, f"config file {path}")
    for section, body in list(values.items()):
        if section == BASE_KEY:
            continue
        if body is None:  # "train:" with nothing under it
            values[section] = {}
        elif not isinstance(body, dict):
            raise ConfigError(
                f"config file {path}: section {quote(section)} must be a mapping "
                f"of keys, got {quote(body)}"
            )
    return values


# A real config holds a few hundred values; YAML aliases can make a few hundred bytes stand
# for billions of them (each alias is a reference, expanded only when walked).
MAX_CONFIG_VALUES = 100_000


def _check_size(values: Any, source: str) -> None:
    """Refuse a YAML document that holds, with its aliases expanded, more than
    :data:`MAX_CONFIG_VALUES` values."""
    count, stack = 0, [values]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{source} holds more than {MAX_CONFIG_VALUES:,} values once its "
                f"YAML aliases are expanded; a config is a few hundred"
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides.

    Example:
        >>> cfg = load_config("configs/shapes_soft.yaml", ["train.epochs=3"])
    """
    values = read_yaml(path) if path is not None else {}
    for text in overrides or []:
        key_path, value = parse_override(text)
        section = _field_type(key_path)
        if dataclasses.is_dataclass(section) and not isinstance(value, dict):
            # Refused here, whatever comes after: a later train.KEY=... would replace it.
            name = ".".join(key_path)
            raise ConfigError(
                f"override {quote(text)}: {name} is a section of keys, not a "
                f"value; set one of its keys, e.g. --set "
                f"{name}.{dataclasses.fields(section)[0].name}=..."
            )
        _deep_update(values, _nest(key_path, value))
    return config_from_dict(values)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (every key, so the run is self-describing).

    Raises:
        ConfigError: in one line, when the file cannot be written (a full disk, no
            permission).
    """
    try:
        with open_unlinked(path, text=True) as handle:  # never through a link left there
            handle.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot write ({exc.strerror or exc}); free some space or choose another --out"
        ) from exc
