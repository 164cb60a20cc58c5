"""Encoders, attention, decoder and the assembled captioner."""

from captioning.models.attention import (
    AttentionOutput,
    AttentionSizes,
    HardAttention,
    HardContext,
    NoAttention,
    SoftAttention,
    build_attention,
    register_attention,
)
from captioning.models.captioner import Captioner, build_model
from captioning.models.decoder import Decoder, DecoderOutput, DecoderState
from captioning.models.encoder import Encoder, build_encoder, register_encoder
from captioning.models.scores import make_score, register_score
from captioning.models.trace import AttentionTrace

__all__ = [
    "AttentionOutput",
    "AttentionSizes",
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
    "make_score",
    "register_attention",
    "register_encoder",
    "register_score",
]
