"""The benchmark: its naive reference must compute what ours computes, and a quick run must
write every measurement and check."""

import json
import math
from functools import partial

import pytest
import torch

from captioning import bench
from captioning.bench import (
    ReferenceDecoder,
    check_reference,
    end_biased,
    reference_beam_search,
    reference_greedy,
)
from captioning.config import load_config
from captioning.decoding import beam_search, greedy_decode
from captioning.losses import caption_loss
from captioning.models import build_model
from captioning.vocab import Vocabulary

TINY = [
    "model.encoder=small_cnn",
    "model.image_size=16",
    "model.cnn_channels=[8,16,16]",
    "model.fine_tune=all",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.attention_dim=16",
    "model.dropout=0",
]
VOCAB = 20
MAX_LENGTH = 8


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors gain nothing from threads, and a CPU shared with other work makes every
    # multi-threaded op wait for a descheduled thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_decoder(*overrides, vocab=VOCAB):
    torch.manual_seed(0)
    return build_model(load_config(None, [*TINY, *overrides]).model, vocab).decoder.eval()


def tiny_data(batch=5, length=7):
    """Features (B, 16, 16): a 4x4 grid of 16 dims; captions <start> words <end>."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(batch, 16, 16, generator=g)
    tokens = torch.randint(4, VOCAB, (batch, length), generator=g)
    tokens[:, 0] = Vocabulary.start_id
    tokens[:, -1] = Vocabulary.end_id
    return features, tokens


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.score=general"],
        ["model.gate=vector", "model.deep_output=false"],
        ["model.context_to_lstm=false", "model.gate=none", "model.init_state=linear"],
    ],
    ids=["additive", "general", "vector-gate-no-deep-output", "context-outside-the-lstm"],
)
def test_reference_teacher_forcing_matches_ours(overrides):
    decoder = tiny_decoder(*overrides).train()  # dropout is 0: train mode is deterministic
    features, tokens = tiny_data()
    ours = decoder(features, tokens[:, :-1])
    reference = ReferenceDecoder(decoder)(features, tokens[:, :-1])
    assert ours.logits.shape == reference.logits.shape == (5, 6, VOCAB)
    assert (ours.logits - reference.logits).abs().max() < 1e-5
    assert torch.allclose(ours.alphas, reference.alphas, atol=1e-6)
    assert torch.allclose(ours.betas, reference.betas, atol=1e-6)
    # the reference trains the same weights: same loss, same gradients
    grads = []
    for output in (ours, reference):
        decoder.zero_grad()
        caption_loss(output, tokens[:, 1:], Vocabulary.pad_id).total.backward()
        grads.append([p.grad.clone() for p in decoder.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def decoders_by_ending(setting, decode):
    """An fp64 decoder that never ends a caption, ends about half of ``decode``'s captions
    early, or is left as it is."""
    decoder = tiny_decoder().double()
    features, tokens = tiny_data(batch=8)
    features = features.double()
    if setting == "early":
        decoder, _ = end_biased(decoder, features, tokens, decode, MAX_LENGTH)
    elif setting == "never":
        with torch.no_grad():
            decoder.out.bias[Vocabulary.end_id] -= 1e3
    return decoder, features


@pytest.mark.parametrize("setting", ["plain", "early", "never"])
@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_reference_beam_search_matches_ours(beam_size, setting):
    decode = partial(beam_search, beam_size=beam_size, max_length=MAX_LENGTH)
    decoder, features = decoders_by_ending(setting, decode)
    ours = decode(decoder, features)
    reference = reference_beam_search(
        ReferenceDecoder(decoder), features, beam_size=beam_size, max_length=MAX_LENGTH
    )
    assert torch.equal(ours.tokens, reference.tokens)
    assert torch.equal(ours.lengths, reference.lengths)
    assert torch.allclose(ours.scores.double(), reference.scores.double(), atol=1e-6)
    assert torch.allclose(ours.alphas.float(), reference.alphas, atol=1e-6)
    ended = ours.lengths < MAX_LENGTH
    if setting == "never":
        assert not ended.any()
    if setting == "early":
        # finished and live beams compete: some captions end, not only at the first word
        assert 0 < ended.sum() < len(ended)
        assert (ours.lengths[ended] > 1).any()


@pytest.mark.parametrize("setting", ["plain", "early", "never"])
def test_reference_greedy_matches_ours(setting):
    decode = partial(greedy_decode, max_length=MAX_LENGTH)
    decoder, features = decoders_by_ending(setting, decode)
    ours = decode(decoder, features)
    reference = reference_greedy(ReferenceDecoder(decoder), features, max_length=MAX_LENGTH)
    assert torch.equal(ours.tokens, reference.tokens)
    assert torch.equal(ours.lengths, reference.lengths)
    assert torch.allclose(ours.scores.double(), reference.scores.double(), atol=1e-6)
    for row, length in enumerate(ours.lengths.tolist()):
        steps = min(length + 1, MAX_LENGTH)  # the words and the <end> step
        assert torch.allclose(ours.alphas[row, :steps].float(), reference.alphas[row, :steps])
    # beam search with one beam is greedy decoding, in the reference too
    one_beam = reference_beam_search(
        ReferenceDecoder(decoder), features, beam_size=1, max_length=MAX_LENGTH
    )
    assert torch.equal(one_beam.lengths, reference.lengths)
    if setting == "early":
        ended = ours.lengths < MAX_LENGTH
        assert 0 < ended.sum() < len(ended)


END, A, B, C, D, X = Vocabulary.end_id, 4, 5, 6, 7, 8


def markov_decoder(table, vocab=9):
    """A real decoder whose next word depends only on the previous one: the deep output
    sees tanh(E y) = onehot(y) / 2 alone, and the output layer holds 2 log p(word | y)."""
    decoder = tiny_decoder(vocab=vocab)
    with torch.no_grad():
        for layer in (decoder.hidden_to_out, decoder.context_to_out, decoder.out):
            layer.weight.zero_()
            layer.bias.zero_()
        decoder.embedding.weight.zero_()
        decoder.embedding.weight[range(vocab), range(vocab)] = math.atanh(0.5)
        for previous in range(vocab):
            probs = torch.full((vocab,), 1e-6)
            for word, p in table.get(previous, {END: 1.0}).items():
                probs[word] = p
            decoder.out.weight[:, previous] = 2 * torch.log(probs / probs.sum())
    return decoder.double()


def test_a_finished_caption_gives_way_to_a_better_one_found_later():
    # k = 2. After one word the beams are "a" (0.5) and "b" (0.3). Next, "b <end>" (0.27)
    # finishes, but the live "a d" (0.49) scores higher, so the search goes on and finds
    # "a d <end>" (0.44): stopping at the first finished caption would return "b".
    table = {
        Vocabulary.start_id: {A: 0.5, B: 0.3, C: 0.2},
        A: {D: 0.98, END: 0.02},
        B: {END: 0.9, X: 0.1},
        D: {END: 0.9, X: 0.1},
    }
    decoder = markov_decoder(table)
    features = torch.randn(3, 16, 16, dtype=torch.float64)
    ours = beam_search(decoder, features, beam_size=2, max_length=6)
    reference = reference_beam_search(
        ReferenceDecoder(decoder), features, beam_size=2, max_length=6
    )
    assert ours.tokens.tolist() == reference.tokens.tolist() == [[A, D, 0]] * 3
    assert torch.allclose(reference.scores, torch.tensor(math.log(0.5 * 0.98 * 0.9)), atol=1e-4)
    assert torch.allclose(ours.scores.double(), reference.scores.double(), atol=1e-6)


def test_reference_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="soft attention"):
        ReferenceDecoder(tiny_decoder("model.attention=hard"))
    features, _ = tiny_data()
    with pytest.raises(ValueError, match="length_penalty"):
        reference_beam_search(ReferenceDecoder(tiny_decoder()), features, length_penalty=0.7)


def test_check_reference_reports_a_wrong_reference(monkeypatch):
    def drops_a_word(*args, **kwargs):
        decoded = reference_beam_search(*args, beam_size=5, **kwargs)
        decoded.lengths = decoded.lengths - 1
        return decoded

    features, tokens = tiny_data()
    good = check_reference(tiny_decoder(), features, tokens, MAX_LENGTH, torch.device("cpu"))
    assert good["passed"] and good["logits_max_abs_diff"] < 1e-5
    monkeypatch.setitem(bench.DECODERS, "beam5", (bench.DECODERS["beam5"][0], drops_a_word))
    bad = check_reference(tiny_decoder(), features, tokens, MAX_LENGTH, torch.device("cpu"))
    assert not bad["passed"]
    assert bad["captions"]["random"]["beam5"]["equal_share"] == 0.0
    assert bad["captions"]["random"]["beam3"]["equal_share"] == 1.0


def test_quick_run_writes_every_measurement(tmp_path, monkeypatch, capsys):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(torch, "compile", no_compiler)
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--quick", "--device", "cpu", "--compile", "--quiet"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {"environment", "settings", "sizes", "checks", "measurements", "speedups"} <= set(
        results
    )
    assert results["passed"] is True
    assert results["environment"]["torch"] == torch.__version__
    assert results["sizes"]["tiny"]["grid"] == [4, 4]
    assert results["sizes"]["tiny"]["feature_dim"] == 16

    (check,) = results["checks"]
    assert check["logits_max_abs_diff"] <= 1e-5
    for setting in ("random", "end_biased"):
        for task in ("greedy", "beam3", "beam5"):
            assert check["captions"][setting][task]["equal_share"] == 1.0
    assert check["captions"]["end_biased"]["beam5"]["ended_share"] > 0

    rows = results["measurements"]
    timed = [m for m in rows if not m["compiled"]]
    assert {(m["precision"], m["task"], m["impl"]) for m in timed} == {
        (precision, task, impl)
        for precision in ("fp32", "bf16")
        for task in ("decoder_step", "full_step", "greedy", "beam3", "beam5")
        for impl in ("ours", "reference")
        if not (task == "full_step" and impl == "reference")
    }
    for m in timed:
        assert m["error"] is None
        assert len(m["seconds"]) == 1 and m["median_s"] > 0
        assert m["images_per_s"] == pytest.approx(6 / m["median_s"])
        assert m["tokens_per_s"] > 0 and m["peak_memory_mb"] is not None
    compiled = [m for m in rows if m["compiled"]]
    assert len(compiled) == 2 * 5  # ours only, per precision and task
    assert all("no compiler in this test" in m["error"] for m in compiled)
    assert {(r["precision"], r["task"]) for r in results["speedups"]} == {
        (precision, task)
        for precision in ("fp32", "bf16")
        for task in ("decoder_step", "greedy", "beam3", "beam5")
    }

    table = capsys.readouterr().out
    assert "| tiny | cpu | fp32 | beam k=5 | ours |" in table
    assert out.with_suffix(".md").read_text().startswith("# Benchmark")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_one_line_error(tmp_path, capsys):
    assert (
        bench.main(["--sizes", "tiny", "--device", "cuda", "--out", str(tmp_path / "b.json")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "CUDA" in err and "\n" not in err


def _beam_floor():
    """tools/beam_floor.py as a module (tools/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "beam_floor.py"
    spec = importlib.util.spec_from_file_location("beam_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_beam_floor_bounds_the_speed_up_from_a_bench_file(tmp_path, capsys):
    results = {"measurements": [
        {"size": "coco", "device": "cpu", "precision": "fp32", "task": "beam2",
         "impl": "reference", "median_s": 1000.0},
    ]}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results))
    floor = _beam_floor()
    args = ["--beam-size", "2", "--images", "2", "--max-length", "2", "--repeats", "1"]
    assert floor.main([*args, "--no-compile", "--bench", str(path)]) == 0
    out = capsys.readouterr().out
    dense = float(out.split("dense layers:")[1].split(" s")[0])
    tanh = float(out.split("eager tanh:")[1].split(" s")[0])
    # 2 images, first word on 1 beam, second on 2: 2 * 3 * 196 * 512 activations
    assert f"{2 * 3 * 196 * 512 / 1e6:.0f}M values" in out
    assert dense > 0 and tanh > 0
    bound = float(out.split("at most ")[1].split("x")[0])
    assert bound == pytest.approx(1000.0 / (dense + tanh), rel=0.02)
    assert "20x the reference needs 50 s" in out

    # a bench file without that reference is a one-line error
    assert floor.main([*args, "--no-compile", "--bench", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run `captioning bench --sizes coco` first" in err
