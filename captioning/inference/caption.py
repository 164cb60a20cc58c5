"""Inference: a model from its checkpoint, and the one path from images to captions.

:func:`caption_batch` is the only place where a batch is encoded and decoded: validation
during training, ``evaluate``, ``caption``, the quickstart and the benchmark all go through
it, so all of them decode under the same precision and the same decoding settings.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Subset

from captioning.checkpoint import load_checkpoint
from captioning.config import Config, DecodeConfig, config_from_dict, replace_section
from captioning.data import CaptionDataset, collate
from captioning.data.images import DEFAULT_LIMITS, ImageLimits, load_image
from captioning.data.vocab import Vocabulary
from captioning.distributed import SINGLE, World
from captioning.errors import CaptioningError, CheckpointError, DataError
from captioning.folders import Writer
from captioning.inference.decoding import Decoded, decode
from captioning.models import AttentionTrace, Captioner, build_model
from captioning.progress import progress_bar
from captioning.runtime import autocast, batches

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Captioner, Config, Vocabulary]:
    """A model rebuilt from nothing but its checkpoint, in eval mode, with its config and
    vocabulary."""
    payload = load_checkpoint(path)
    cfg, vocab = checkpoint_config(payload, path)
    model = build_model(cfg.model, len(vocab), cfg.runtime)
    load_weights(model, payload, path)
    return model.to(device).eval(), cfg, vocab


def checkpoint_config(payload: dict[str, Any], path: str | Path) -> tuple[Config, Vocabulary]:
    """The config and vocabulary a checkpoint was trained with. The config's
    ``model.weights`` is cleared: the weights are in the checkpoint, and a checkpoint must
    never make the loader read another file."""
    values = dict(payload["config"])
    if isinstance(values.get("model"), dict):
        values["model"] = {**values["model"], "weights": None}
    try:
        cfg = config_from_dict(values)
        vocab = Vocabulary(payload["vocab"])
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config or vocabulary does not load ({exc})") from exc
    return cfg, vocab


def load_weights(model: nn.Module, payload: dict[str, Any], path: str | Path) -> None:
    """Load a checkpoint's weights into ``model``, with a one-line error when they do not
    fit (another vocabulary size, another architecture)."""
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"{path}: its weights do not fit the model its config and vocabulary describe ({first})"
        ) from exc


def with_decoding(
    cfg: Config, beam_size: int | None = None, hard_context: str | None = None
) -> Config:
    """``cfg`` with the decoding asked for on a command line: ``beam_size`` 1 is greedy and
    more is beam search; ``hard_context`` is how a hard-attention model forms its context.
    None keeps the config's own setting."""
    if beam_size is not None:
        strategy = "greedy" if beam_size == 1 else "beam"
        cfg = replace_section(cfg, "decode", strategy=strategy, beam_size=beam_size)
    return replace_section(cfg, "decode", hard_context=hard_context)


@torch.no_grad()
def caption_batch(
    model: Captioner,
    decode_cfg: DecodeConfig,
    precision: str = "fp32",
    images: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    encode_batch: int | None = None,
) -> Decoded:
    """Captions for a batch of ``images`` (B, 3, S, S), or of cached backbone grids
    (B, L, D), under ``precision`` (``runtime.precision`` of the run) and ``decode_cfg``.
    ``encode_batch`` encodes the images that many at a time (the decoding still runs on the
    whole batch; each image's features do not depend on the others'). The model should be
    in eval mode."""
    device = (images if images is not None else grid).device
    with autocast(device, precision):
        if images is not None and encode_batch is not None and encode_batch < len(images):
            features = torch.cat([model.encode(part) for part in images.split(encode_batch)])
        else:
            features = model.encode(images, grid)  # (B, L, D)
        return decode(model.decoder, features, decode_cfg)


# Per word of a caption, the boxes of the objects it names: (x, y, width, height) as shares of
# the image's width and height.
Boxes = Sequence[Sequence[tuple[float, float, float, float]]]


@dataclass
class Caption:
    """One captioned image: its words, and where the model looked for each.

    Every field of the trace is also an attribute under its public name, the name the JSON
    gives it: ``attention`` (or ``alphas``) the maps, and from the models that report them
    ``cells`` (the cell hard attention chose for each word, a list), ``heads`` (T, H, rows,
    cols) and ``centres`` (T, 2), None for the other models (see
    :class:`~captioning.models.trace.AttentionTrace`).

    Attributes:
        caption: the words joined by spaces.
        words: the caption's words (``<end>`` is no word of it).
        trace: the attention record of each word, (T, ...) on the CPU in fp32: ``alpha``
            (T, L), and whatever else the model's attention reports.
        source: what the image was called: its path, or ``image N`` for an in-memory one.
        grid: the attention grid, ``(rows, cols)``; None when unknown (maps stay flat).
        image: the RGB image as it was captioned (upright, its own size), when it was kept.
    """

    caption: str
    words: list[str]
    trace: AttentionTrace
    source: str
    grid: tuple[int, int] | None = None
    image: Image.Image | None = None

    @classmethod
    def from_decoded(
        cls,
        source: str,
        decoded: Decoded,
        vocab: Vocabulary,
        grid: tuple[int, int] | None = None,
    ) -> Caption:
        """The caption of one image from its single-image ``decoded`` (see
        :meth:`Decoded.row`): the caption's words, each with its record. ``<end>`` is no
        word of the caption, so its record is not kept."""
        length = int(decoded.lengths)
        words = vocab.decode_tokens(decoded.tokens[:length].tolist())
        trace = decoded.trace[:length].portable()  # (T, ...)
        return cls(caption=" ".join(words), words=words, trace=trace, source=source, grid=grid)

    @property
    def alphas(self) -> torch.Tensor:
        """The attention behind each word, ``(words, rows, cols)`` (``(words, L)`` without a
        grid), each map summing to one."""
        return self.trace.shown("attention", self.grid)

    def __getattr__(self, name: str) -> Any:
        trace = self.__dict__.get("trace")
        if trace is not None and not name.startswith("_"):
            try:
                return trace.shown(name, self.grid)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.trace.public_names()})

    def plot(self, smooth: bool = True, columns: int = 5, boxes: Boxes | None = None) -> Figure:
        """A figure of the image and one heatmap per word (hard attention: the chosen cell
        outlined; local attention: the centre crossed; ``boxes``, per word the boxes of the
        objects it names as shares (x, y, width, height) of the image, outlined: see
        :func:`captioning.metrics.pointing.word_boxes`). Nothing is shown on screen or
        written: a notebook displays it, and ``.savefig(path)`` writes it."""
        from captioning.figures.trace import trace_grid

        _notebooks_show_figures()
        return trace_grid(
            self._picture(),
            self.words,
            self.trace,
            self._grid(),
            smooth,
            columns,
            self.caption,
            boxes=boxes,
        )

    def save(self, path: str | Path, smooth: bool = True, boxes: Boxes | None = None) -> Path:
        """Write :meth:`plot` as a PNG at ``path`` (parent folders are created)."""
        from captioning.figures.trace import trace_figure

        return trace_figure(
            self._picture(),
            self.words,
            self.trace,
            self._grid(),
            path,
            smooth,
            title=self.caption,
            boxes=boxes,
        )

    def save_gif(self, path: str | Path, smooth: bool = True) -> Path:
        """Write an animated GIF at ``path``: one frame per word, its heatmap over the image."""
        from captioning.figures.trace import trace_gif

        return trace_gif(self._picture(), self.words, self.trace, self._grid(), path, smooth)

    def plot_heads(self, smooth: bool = True) -> Figure:
        """A figure of each head's heatmap per word (one row per head, then their mean).

        Raises:
            ConfigError: the model has a single attention head."""
        from captioning.figures.trace import trace_heads_grid

        _notebooks_show_figures()
        return trace_heads_grid(
            self._picture(), self.words, self.trace, self._grid(), smooth, self.caption
        )

    def save_heads(self, path: str | Path, smooth: bool = True) -> Path:
        """Write :meth:`plot_heads` as a PNG at ``path`` (parent folders are created)."""
        from captioning.figures.trace import trace_heads_figure

        return trace_heads_figure(
            self._picture(), self.words, self.trace, self._grid(), path, smooth, self.caption
        )

    def to_dict(self, decimals: int = 4) -> dict[str, Any]:
        """Plain JSON data: ``caption``, ``words``, ``attention`` (one rows x cols map per
        word), ``grid``, and the trace's other fields under their public names: ``cells``,
        ``heads`` (H rows x cols maps per word), ``centres`` ((row, column) per word) and
        any other, each null for the models without it. Numbers are rounded to
        ``decimals``; a NaN is null."""
        grid = self._grid()
        (maps, values), *others = self.trace.to_json(grid, decimals).items()  # alpha's first
        return {
            "caption": self.caption,
            "words": list(self.words),
            maps: values,
            "grid": list(grid),
            **dict(others),
        }

    def extras(self, decimals: int = 4) -> dict[str, Any]:
        """The trace's fields but the maps, as :meth:`to_dict` writes them: ``cells``,
        ``heads``, ``centres`` and any other, each null for the models without it."""
        return self.trace.to_json(self._grid(), decimals, optional_only=True)

    def _grid(self) -> tuple[int, int]:
        if self.grid is None:
            raise ValueError(
                f"{self.source}: the caption does not know its attention grid; "
                "pass grid=model.grid_shape to Caption.from_decoded"
            )
        return self.grid

    def _picture(self) -> Image.Image:
        if self.image is None:
            raise ValueError(
                f"{self.source}: the caption kept no image to draw on; set "
                "its image (load_image(path)) first"
            )
        return self.image

    def _repr_png_(self) -> bytes:
        """A notebook shows a caption as its figure."""
        buffer = io.BytesIO()
        figure = self.plot()
        figure.savefig(buffer, format="png")
        figure.clear()
        return buffer.getvalue()


# The name training's epoch figures use for a caption.
CaptionResult = Caption


@dataclass
class Failed:
    """An input that could not be captioned, and why (one line that names it)."""

    source: str
    error: str


def _notebooks_show_figures() -> None:
    """In IPython, show a matplotlib figure as a PNG, as ``%matplotlib inline`` would: the
    figure is built without pyplot, so no backend registers it."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None:
        return
    from IPython.core.pylabtools import print_figure
    from matplotlib.figure import Figure

    formatter = shell.display_formatter.formatters["image/png"]
    formatter.for_type(Figure, lambda figure: print_figure(figure, "png"))


def decode_dataset(
    model: Captioner,
    dataset: CaptionDataset,
    cfg: Config,
    device: torch.device,
    batch_size: int | None = None,
    progress: bool = False,
    desc: str = "decoding",
    world: World = SINGLE,
    summary: bool = True,
) -> tuple[dict[int, str], dict[int, Decoded]]:
    """Captions for every image of ``dataset`` with the config's decoding settings, in
    batches of ``batch_size`` images (None: ``runtime.batch_size``) under
    ``runtime.precision``.

    ``progress`` shows a bar of images on a terminal, and elsewhere logs one line when the
    decoding ends (unless ``summary`` is False: training's epoch line reports validation).

    Returns ``{image_id: caption}`` and, per image id, its single-image :class:`Decoded`
    (tokens, attention maps) for figures and grounding. With several processes each
    decodes every ``world.size``-th image, starting at its rank.
    """
    shard = dataset
    if world.enabled:
        shard = Subset(dataset, range(world.rank, len(dataset), world.size))
    loader = DataLoader(
        shard,
        batch_size=batch_size or cfg.runtime.batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )
    model.eval()
    captions: dict[int, str] = {}
    details: dict[int, Decoded] = {}
    bar = progress_bar(
        desc=desc, total=len(shard), unit="img", enabled=progress, summary=summary, leave=False
    )
    for batch in batches(loader):
        if batch is None:
            continue
        decoded = caption_batch(
            model,
            cfg.decode,
            cfg.runtime.precision,
            images=batch["images"].to(device) if "images" in batch else None,
            grid=batch["grid"].to(device) if "grid" in batch else None,
        )
        texts = decoded.captions(dataset.vocab)
        for row, index in enumerate(batch["indices"].tolist()):
            image_id = dataset.records[index].image_id
            captions[image_id] = texts[row]
            details[image_id] = decoded.row(row)
        bar.update(len(texts))
    bar.close()
    return captions, details


# One image to caption: a name for messages and results, and how to get its RGB pixels
# (a callable that may raise DataError, so that a bad image fails on its own).
ImageSource = tuple[str, Callable[[], Image.Image]]


# An image read for captioning: its name, its RGB pixels and its encoder input (3, S, S).
ReadImage = tuple[str, Image.Image, torch.Tensor]


def read_images(
    sources: Iterable[ImageSource],
    transform: Callable[[Image.Image], torch.Tensor],
    batch_size: int = 16,
) -> Iterator[list[ReadImage] | Failed]:
    """Open, convert and resize (``transform``) every image of ``sources``, in order:
    batches of up to ``batch_size`` read images, and a :class:`Failed` in the place of each
    one whose loader raises :class:`DataError` (the batch read before it comes first). No
    model runs here, so callers may read while another thread decodes."""
    pending: list[ReadImage] = []
    for name, load in sources:
        try:
            picture = load()
        except DataError as exc:
            if pending:
                yield pending
                pending = []
            yield Failed(source=name, error=str(exc))
            continue
        pending.append((name, picture, transform(picture)))
        if len(pending) == batch_size:
            yield pending
            pending = []
    if pending:
        yield pending


def caption_read(
    batch: list[ReadImage], model: Captioner, vocab: Vocabulary, cfg: Config, device: torch.device
) -> list[Caption]:
    """Caption a batch of :func:`read_images` in one decoding; each caption keeps the RGB
    image it was captioned from in ``image``."""
    images = torch.stack([tensor for *_, tensor in batch]).to(device)  # (B, 3, S, S)
    results = caption_inputs(images, [name for name, *_ in batch], model, vocab, cfg)
    for result, (_, picture, _) in zip(results, batch):
        result.image = picture
    return results


def caption_images(
    sources: Iterable[ImageSource],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    device: torch.device,
    batch_size: int = 16,
) -> Iterator[Caption | Failed]:
    """Caption every image of ``sources`` in order, ``batch_size`` at a time; one whose
    loader raises :class:`DataError` yields a :class:`Failed` (and never stops the others).
    Each caption keeps the RGB image it was captioned from in ``image``."""
    model.eval()
    for batch in read_images(sources, model.encoder.transform, batch_size):
        if isinstance(batch, Failed):
            yield batch
        else:
            yield from caption_read(batch, model, vocab, cfg, device)


def caption_inputs(
    images: torch.Tensor,
    names: Sequence[str],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    encode_batch: int | None = None,
) -> list[Caption]:
    """Caption a batch of encoder inputs in one decoding (one batched beam search).

    Args:
        images: uint8 (B, 3, S, S), as ``model.encoder.transform`` makes them, on the
            model's device.
        names: what each result calls its image.
        model: the network, in eval mode.
        vocab: its vocabulary.
        cfg: the config whose ``decode`` settings and ``runtime.precision`` apply.
        encode_batch: images encoded at once (None: all); see :func:`caption_batch`.
    """
    decoded = caption_batch(
        model, cfg.decode, cfg.runtime.precision, images=images, encode_batch=encode_batch
    )
    return [
        Caption.from_decoded(name, decoded.row(row), vocab, model.grid_shape)
        for row, name in enumerate(names)
    ]


def caption_files(
    paths: Sequence[str],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    device: torch.device,
    batch_size: int = 16,
) -> Iterator[Caption | Failed]:
    """Caption every readable file in ``paths``, in order; unreadable ones yield a
    :class:`Failed` (and never stop the others)."""
    limits = ImageLimits.from_config(cfg.data)
    sources = ((str(path), partial(load_image, path, limits)) for path in paths)
    return caption_images(sources, model, vocab, cfg, device, batch_size)


# The folder of attention figures (``caption --attention-dir``): its figures are named after
# the images, so it is only ever a new or empty folder, or one the caption verb wrote, never
# one of pictures that a figure could replace.
CAPTION = Writer("caption")


def figure_stem(path: str, used: set[str]) -> str:
    """A file-name stem for ``path`` that no earlier image took (photos often share names)."""
    stem = Path(path).stem or "image"
    candidate, n = stem, 1
    while candidate in used:
        n += 1
        candidate = f"{stem}_{n}"
    used.add(candidate)
    return candidate


def draw_attention(
    result: Caption,
    grid_shape: tuple[int, int],
    out_dir: str | Path,
    stem: str,
    smooth: bool = True,
    gif: bool = False,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> Path | None:
    """Write the per-word attention figure ``STEM.png`` (and optionally ``STEM.gif``) of a
    caption into ``out_dir``, as :meth:`Caption.save` draws it; the image is read from the
    caption's ``source`` when it kept none. Returns the PNG's path, or None for an empty
    caption (nothing to show)."""
    if not result.words:
        return None
    image = result.image if result.image is not None else load_image(result.source, limits)
    result = replace(result, grid=grid_shape, image=image)
    out_dir = Path(out_dir)
    figure = result.save(out_dir / f"{stem}.png", smooth)
    if gif:
        result.save_gif(out_dir / f"{stem}.gif", smooth)
    return figure
