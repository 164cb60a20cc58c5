"""Captioner = encoder + decoder, and :func:`build_model`, the one place where config strings
become modules."""

from __future__ import annotations

import torch
from torch import nn

from captioning.config import ModelConfig, RuntimeConfig
from captioning.errors import ConfigError
from captioning.models.attention import (
    EXPECTATION,
    AttentionSizes,
    HardContext,
    MultiHeadAttention,
    build_attention,
)
from captioning.models.decoder import Decoder, DecoderOutput
from captioning.models.encoder import Encoder, build_encoder
from captioning.models.scores import groups
from captioning.models.word_maps import ExpectedWordScore, WordLocaliser


class Captioner(nn.Module):
    """An image encoder and an attention LSTM decoder.

    Args:
        encoder: images (B, 3, S, S) → grid features (B, L, D).
        decoder: the attention LSTM over those features.
        grid: self-attention over the encoder's cells before the decoder (None: none).
        word_maps: a word localiser trained beside the decoder, whose maps teacher forcing
            reports with each caption (None: none; decoding never uses it).
    """

    def __init__(
        self,
        encoder: Encoder,
        decoder: Decoder,
        grid: GridSelfAttention | None = None,
        word_maps: WordLocaliser | None = None,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.grid = grid
        self.decoder = decoder
        self.word_maps = word_maps

    @property
    def hard_attention(self) -> bool:
        """Whether the decoder attends to one sampled cell per word (hard attention)."""
        return self.decoder.attention.stochastic

    @property
    def attention_heads(self) -> int:
        """H, the decoder's attention heads (1 for every attention but multi-head)."""
        attention = self.decoder.attention
        return len(attention.heads) if isinstance(attention, MultiHeadAttention) else 1

    @property
    def grid_shape(self) -> tuple[int, int]:
        """The (rows, columns) of the attention grid."""
        return self.encoder.grid_shape

    def encode(
        self, images: torch.Tensor | None = None, grid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decoder features (B, L, D) from ``images`` (B, 3, S, S), or from a cached backbone
        ``grid`` (B, L, D) (see :mod:`captioning.data.feature_cache`)."""
        if grid is not None:
            features = self.encoder.add_positions(grid.float())
        elif images is None:
            raise ValueError("give images or a cached grid")
        else:
            features = self.encoder(images)
        return features if self.grid is None else self.grid(features)

    def forward(
        self,
        images: torch.Tensor | None,
        tokens: torch.Tensor,
        grid: torch.Tensor | None = None,
        hard: HardContext = EXPECTATION,
        repeat: int = 1,
        present: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Teacher forcing on a batch: ``tokens`` (B, T) are whole captions
        (``<start> … <end> <pad>…``); the outputs predict ``tokens[:, 1:]``. With a cached
        backbone ``grid`` (B, L, D), ``images`` may be None. ``repeat`` > 1 decodes every
        caption that many times (rows image-major: B*repeat), encoding each image and
        projecting its grid once; ``tokens`` may then also hold B*repeat rows, one caption
        per decoded row. ``present`` (B, K), the words known to be in each image, are the
        word localiser's positives (None: each caption's own words)."""
        features = self.encode(images, grid)  # (B, L, D)
        if repeat > 1 and tokens.shape[0] != features.shape[0] * repeat:
            tokens = tokens.repeat_interleave(repeat, dim=0)  # (B*repeat, T)
        targets = tokens[:, 1:] if hard.mode == "marginal" else None
        output = self.decoder(features, tokens[:, :-1], hard, targets)
        if self.word_maps is not None:
            cells, _ = self.decoder.split(features)
            cells = cells.repeat_interleave(groups(cells, tokens.shape[0]), dim=0)
            if present is not None:
                present = present.repeat_interleave(tokens.shape[0] // present.shape[0], dim=0)
            output.word_maps = self.word_maps(cells, tokens[:, 1:], present)
        score = getattr(self.decoder.attention, "score", None)
        if isinstance(score, ExpectedWordScore):  # its layer's reading, for its own loss
            output.expected_logits = score.expect(output.queries.detach())
        return output

    def localiser_maps(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The word localiser's map of each word of ``tokens`` (B, T) over the cells of
        ``features`` (B, L, D), from :meth:`encode`: (B, T, L). Needs ``model.word_maps``."""
        if self.word_maps is None:
            raise ValueError("the model has no word localiser (model.word_maps)")
        cells, _ = self.decoder.split(features)
        words, index = torch.unique(tokens, return_inverse=True)  # (C,), (B, T)
        maps = self.word_maps.maps(cells, words)  # (B, L, C)
        index = index.unsqueeze(1).expand(-1, maps.shape[1], -1)  # (B, L, T)
        return maps.gather(2, index).transpose(1, 2)


def build_model(
    cfg: ModelConfig, vocab_size: int, runtime: RuntimeConfig | None = None
) -> Captioner:
    """The :class:`Captioner` that ``cfg`` describes, running as ``runtime``'s speed
    switches say (None: the defaults; they change no weight and no number)."""
    runtime = runtime or RuntimeConfig()
    encoder = build_encoder(cfg, runtime)  # first: after one seed, one random encoder
    context_dim = cfg.value_dim if cfg.values == "projected" else encoder.out_channels
    sizes = AttentionSizes(
        encoder.out_channels, cfg.hidden_dim, encoder.num_cells, encoder.grid_shape, context_dim
    )
    attention = build_attention(cfg, sizes)
    word_maps = None
    if cfg.word_maps:
        word_maps = WordLocaliser(
            encoder.out_channels,
            vocab_size,
            cfg.word_map_rank,
            cfg.word_map_sharpness,
            tied=cfg.word_map_classes == "categories",
        )
        if cfg.word_attention:
            attention.score = ExpectedWordScore(
                attention.score,
                word_maps,
                cfg.hidden_dim,
                vocab_size,
                restricted=cfg.word_attention_words == "categories",
            )
    decoder = Decoder(
        vocab_size=vocab_size,
        feature_dim=encoder.out_channels,
        attention=attention,
        embed_dim=cfg.embed_dim,
        hidden_dim=cfg.hidden_dim,
        gate=cfg.gate,
        deep_output=cfg.deep_output,
        context_to_lstm=cfg.context_to_lstm,
        query=cfg.query,
        init_state=cfg.init_state,
        dropout=cfg.dropout,
        value_dim=cfg.value_dim if cfg.values == "projected" else None,
        parallel=runtime.parallel_decoder,
        summary_dim=encoder.summary_dim,
        summary_rows=encoder.summary_rows,
        summary=cfg.summary,
        context_words=cfg.context_words,
        summary_gate=cfg.summary_gate,
    )
    grid = None
    if cfg.grid_layers:
        grid = GridSelfAttention(encoder.out_channels, cfg.grid_layers, cfg.grid_heads)
    return Captioner(encoder, decoder, grid, word_maps)


class GridSelfAttention(nn.Module):
    """``layers`` pre-norm Transformer encoder layers over the L cells of a grid (B, L, D):
    every cell's feature can then depend on every other cell. Each layer starts as the
    identity (the output projections of its attention and feed-forward blocks are zero, as in
    ReZero and Fixup), so the decoder first sees the grid unchanged and the layers add
    relations to it as they learn; there is no final normalisation, which would rescale the
    features the decoder attends over.

    Args:
        dim: D, the feature size (divisible by ``heads``).
        layers: the number of layers.
        heads: attention heads per layer.
        dropout: dropout inside the layers (kept small: the decoder has its own).
    """

    def __init__(self, dim: int, layers: int, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(
                f"model.grid_heads={heads} must divide the encoder's feature size {dim}"
            )
        layer = nn.TransformerEncoderLayer(
            dim,
            heads,
            dim_feedforward=4 * dim,
            dropout=dropout,
            batch_first=True,
            norm_first=True,
        )
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        for block in self.layers.layers:
            for out in (block.self_attn.out_proj, block.linear2):
                nn.init.zeros_(out.weight)
                nn.init.zeros_(out.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Features (B, L, D) → features (B, L, D)."""
        return self.layers(features)
