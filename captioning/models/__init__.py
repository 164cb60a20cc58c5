"""Encoders, attention, decoder and the assembled captioner."""

from captioning.models.attention import (
    AttentionOutput,
    HardAttention,
    HardContext,
    NoAttention,
    SoftAttention,
    build_attention,
    make_score,
)
from captioning.models.captioner import Captioner, build_model, encoder_from_config
from captioning.models.decoder import Decoder, DecoderOutput, DecoderState
from captioning.models.encoder import Encoder, build_encoder
from captioning.models.trace import AttentionTrace

__all__ = [
    "AttentionOutput",
    "AttentionTrace",
    "Captioner",
    "Decoder",
    "DecoderOutput",
    "DecoderState",
    "Encoder",
    "HardAttention",
    "HardContext",
    "NoAttention",
    "SoftAttention",
    "build_attention",
    "build_encoder",
    "build_model",
    "encoder_from_config",
    "make_score",
]
