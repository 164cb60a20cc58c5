"""Self-critical sequence training: rewards, baselines, the log-probability of a sample,
and one step's effect on a toy."""

import os

import pytest
import torch

import captioning.objectives.self_critical as scst
from captioning.config import load_config
from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.inference.decoding import Decoded, greedy_decode
from captioning.metrics import tokenize_for_eval
from captioning.models import build_model
from captioning.models.attention import HardContext
from captioning.models.trace import AttentionTrace
from captioning.objectives import Batch
from captioning.objectives.self_critical import (
    CaptionReward,
    SelfCriticalObjective,
    leave_one_out,
    teacher_inputs,
)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")
VOCAB = Vocabulary(
    ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "blue", "circle", "square", "e.g."]
)
RECORDS = [
    ImageRecord(i, f"{i}.png", "train", captions)
    for i, captions in enumerate(
        [
            ("a red circle", "A red circle."),
            ("a blue square", "blue square"),
            ("a red square",),
            ("a blue circle",),
        ]
    )
]


@pytest.fixture(scope="module")
def reward():
    return CaptionReward(RECORDS, VOCAB)


def make(reward, attention="soft", **train):
    overrides = [f"model.attention={attention}", "model.dropout=0.0"]
    cfg = load_config(CONFIG, overrides + [f"train.{k}={v}" for k, v in train.items()])
    torch.manual_seed(0)
    model = build_model(cfg.model, len(VOCAB))
    objective = SelfCriticalObjective(
        cfg, reward, torch.device("cpu"), "fp32", hard=model.hard_attention
    )
    return model, objective


def fixed(*captions: str) -> Decoded:
    """Decoded captions as a sampler would return them (words, then <pad>)."""
    ids = [VOCAB.encode(c, add_special=False) for c in captions]
    steps = max(len(i) for i in ids) + 1  # the step that chose <end>
    tokens = torch.full((len(ids), steps), Vocabulary.pad_id)
    for row, words in enumerate(ids):
        tokens[row, : len(words)] = torch.tensor(words)
    lengths = torch.tensor([len(i) for i in ids])
    return Decoded(
        tokens, lengths, torch.zeros(len(ids)), AttentionTrace(torch.zeros(len(ids), steps, 1))
    )


def test_reward_tokenises_as_evaluation(reward):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, len(VOCAB), (20, 6), generator=generator)  # <unk> and e.g. too
    lengths = torch.randint(0, 7, (20,), generator=generator)
    ours = reward.captions(tokens, lengths)
    raw = {i: [VOCAB.decode(row[:n].tolist())] for i, (row, n) in enumerate(zip(tokens, lengths))}
    expected = tokenize_for_eval(raw)
    assert ours == [expected[i][0] for i in range(20)]
    assert any(c == "" for c in ours) and any("unk" in c for c in ours)


def test_reward_is_cider_d_against_the_training_references(reward):
    rewards = reward(*_ids("a red circle", "a blue square", "red"), keys=[0, 0, 0])
    assert rewards[0] > rewards[2] > rewards[1] == 0.0
    # the references are tokenised as evaluation does: "A red circle." is "a red circle"
    assert reward.references[0] == ["a red circle", "a red circle"]


def _ids(*captions):
    decoded = fixed(*captions)
    return decoded.tokens, decoded.lengths


def test_leave_one_out_excludes_the_sample_itself():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 10.0], [0.0, 0.0, 4.0, 4.0]])
    baseline = leave_one_out(rewards)
    assert torch.allclose(baseline[0], torch.tensor([5.0, 14 / 3, 13 / 3, 2.0]))
    assert torch.allclose(baseline[1], torch.tensor([8 / 3, 8 / 3, 4 / 3, 4 / 3]))
    changed = rewards.clone()
    changed[0, 3] = -50.0  # sample 3's own reward moves every baseline but its own
    moved = leave_one_out(changed)
    assert moved[0, 3] == baseline[0, 3] and (moved[0, :3] != baseline[0, :3]).all()


@pytest.mark.parametrize("baseline", ["loo", "greedy"])
def test_a_step_raises_the_better_sample_and_lowers_the_worse(reward, baseline, monkeypatch):
    model, objective = make(reward, scst_baseline=baseline, scst_samples=2)
    samples = fixed("a red circle", "a blue square")  # image 0: a red circle
    greedy = fixed("a red square") if baseline == "greedy" else None  # reward in between
    monkeypatch.setattr(objective, "_decode", lambda *args: (samples, greedy))
    images = torch.rand(1, 3, 48, 48)
    indices = torch.tensor([0])
    model.eval()
    before = objective.sample_log_probs(model, images, None, samples)[0].sum(dim=1).detach()
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    terms = objective.loss(model, Batch(tokens, images, indices=indices))
    terms.total.backward()
    optimiser.step()
    model.eval()
    after = objective.sample_log_probs(model, images, None, samples)[0].sum(dim=1).detach()
    rewards = reward(samples.tokens, samples.lengths, [0, 0])
    assert rewards[0] > objective.scalars()["baseline"] > rewards[1] - 1e-12
    # the reward has no doubly stochastic term, so the log reports none (not a zero)
    assert "penalty" not in terms.scalars() and "reward" in terms.scalars()
    assert after[0] > before[0] + 1e-3  # the caption that beat its baseline
    assert after[1] < before[1] - 1e-3  # the one that fell short


def test_the_greedy_baseline_is_decoded_without_gradients_in_eval_mode(reward, monkeypatch):
    model, objective = make(reward, scst_baseline="greedy", scst_samples=3)
    seen = []

    def spy(decoder, *args, **kwargs):
        seen.append((torch.is_grad_enabled(), decoder.training))
        return greedy_decode(decoder, *args, **kwargs)

    monkeypatch.setattr(scst, "greedy_decode", spy)
    images = torch.rand(2, 3, 48, 48)
    model.train()
    tokens = torch.zeros(2, 2, dtype=torch.long)
    terms = objective.loss(model, Batch(tokens, images, indices=torch.tensor([0, 1])))
    assert seen == [(False, False)]
    assert model.training  # restored after the loss
    assert terms.total.requires_grad
    model.eval()
    with torch.no_grad():
        greedy = greedy_decode(model.decoder, model.encode(images), max_length=20)
    expected = reward(greedy.tokens, greedy.lengths, [0, 1]).mean()
    assert objective.scalars()["baseline"] == pytest.approx(float(expected), abs=1e-9)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_the_replayed_log_probability_is_the_samples(reward, attention):
    """Teacher forcing the samples (with their cells, for hard attention) reproduces the
    log-probabilities the sampler gave their words and closing <end>."""
    model, objective = make(reward, attention=attention, scst_samples=3)
    model.eval()
    images = torch.rand(2, 3, 48, 48)
    torch.manual_seed(1)
    sampled, _ = objective._decode(model, images, None)
    assert (sampled.lengths < objective.max_length).any()
    inputs = teacher_inputs(sampled, objective.max_length)  # (R, T+2)
    hard = HardContext()
    if attention == "hard":
        cells = torch.zeros_like(inputs[:, 1:])
        cells[:, : sampled.trace.cell.shape[1]] = sampled.trace.cell
        hard = HardContext(mode="sample", cells=cells)
    with torch.no_grad():
        output = model(images, inputs, hard=hard, repeat=3)
    targets = inputs[:, 1:]
    mask = targets != Vocabulary.pad_id
    words = torch.log_softmax(output.logits, dim=2).gather(2, targets.unsqueeze(2)).squeeze(2)
    assert torch.allclose((words * mask).sum(dim=1), sampled.scores, atol=1e-4)
    assert int(mask.sum()) == int(sampled.lengths.sum() + (sampled.lengths < 20).sum())
    total, objective_mask = objective.sample_log_probs(model, images, None, sampled)
    assert torch.equal(objective_mask.bool(), mask)
    # the sampler's distribution: <pad>, <start> and <unk> never drawn, <end> not at the
    # first word
    logits = output.logits.clone()
    logits[:, :, [Vocabulary.pad_id, Vocabulary.start_id, Vocabulary.unk_id]] = float("-inf")
    logits[:, 0, Vocabulary.end_id] = float("-inf")
    drawn = torch.log_softmax(logits, dim=2).gather(2, targets.unsqueeze(2)).squeeze(2)
    expected = torch.where(mask, drawn, 0.0).sum(dim=1)
    if attention == "hard":  # the cells' log-probabilities are part of the sample's
        cells_part = (output.log_probs * mask).sum(dim=1)
        assert (cells_part < -0.1).all()
        expected = expected + cells_part
    assert torch.allclose(total.sum(dim=1), expected, atol=1e-5)
