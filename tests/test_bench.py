"""The benchmark: its naive reference must compute what ours computes, what it times must be
the package's own training step and decoding, and a quick run must write every measurement
and check."""

import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from benchmarks import (
    allocator,
    beam_floor,
    bench,
    bench_report,
    reference_decoding,
    train_floor,
    workload,
)
from benchmarks.reference import ReferenceDecoder, load_reference
from benchmarks.reference_check import check_reference, end_biased
from benchmarks.reference_decoding import reference_beam_search, reference_greedy
from captioning.config import load_config
from captioning.data.vocab import Vocabulary
from captioning.inference import caption as inference
from captioning.inference.decoding import beam_search, greedy_decode
from captioning.models import build_model, fused_score
from captioning.objectives.cross_entropy import caption_loss
from captioning.training import step as training_step
from lab.results import ResultsError
from tests.conftest import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.encoder=small_cnn",
    "model.image_size=16",
    "model.cnn_channels=[8,16,16]",
    # The decoder's weights are drawn after the encoder's: with the plain blocks' draws the
    # "early" regime below ends captions both at the first word and later ones.
    "model.cnn_block=plain",
    "model.fine_tune=all",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.attention_dim=16",
    "model.dropout=0",
]
VOCAB = 20
FEATURE_DIM = 16
MAX_LENGTH = 8


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors gain nothing from threads, and a CPU shared with other work makes every
    # multi-threaded op wait for a descheduled thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(*overrides, vocab=VOCAB):
    """The model section and the decoder (eval mode) of a tiny model."""
    cfg = load_config(None, [*TINY, *overrides]).model
    torch.manual_seed(0)
    return cfg, build_model(cfg, vocab).decoder.eval()


def tiny_decoder(*overrides, vocab=VOCAB):
    return tiny_model(*overrides, vocab=vocab)[1]


def reference_of(decoder, *overrides):
    """The reference with ``decoder``'s weights (built from the tiny model's section)."""
    return load_reference(load_config(None, [*TINY, *overrides]).model, decoder.state_dict())


def tiny_data(batch=5, length=7):
    """Features (B, 16, 16): a 4x4 grid of 16 dims; captions <start> words <end>."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(batch, 16, FEATURE_DIM, generator=g)
    tokens = torch.randint(4, VOCAB, (batch, length), generator=g)
    tokens[:, 0] = Vocabulary.start_id
    tokens[:, -1] = Vocabulary.end_id
    return features, tokens


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.score=additive_relu"],
        ["model.gate=vector", "model.deep_output=false"],
        ["model.context_to_lstm=false", "model.gate=none", "model.init_state=linear"],
    ],
    ids=["additive", "additive-relu", "vector-gate-no-deep-output", "context-outside-the-lstm"],
)
def test_reference_teacher_forcing_matches_ours(overrides):
    decoder = tiny_decoder(*overrides).train()  # dropout is 0: train mode is deterministic
    ref = reference_of(decoder, *overrides).train()
    features, tokens = tiny_data()
    ours = decoder(features, tokens[:, :-1])
    theirs = ref(features, tokens[:, :-1])
    assert ours.logits.shape == theirs.logits.shape == (5, 6, VOCAB)
    assert (ours.logits - theirs.logits).abs().max() < 1e-5
    assert torch.allclose(ours.alphas, theirs.alphas, atol=1e-6)
    assert torch.allclose(ours.betas, theirs.betas, atol=1e-6)
    # the reference trains the same weights: same loss, same gradient for every weight
    grads = []
    for module, output in ((decoder, ours), (ref, theirs)):
        caption_loss(output, tokens[:, 1:], Vocabulary.pad_id).total.backward()
        grads.append({name: p.grad for name, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-5), name


LAYOUTS = [
    (gate, deep_output, context_to_lstm)
    for gate in ("scalar", "vector", "none")
    for deep_output in (True, False)
    for context_to_lstm in (True, False)
    if deep_output or context_to_lstm  # the decoder needs the context somewhere
]


@pytest.mark.parametrize("gate, deep_output, context_to_lstm", LAYOUTS)
def test_reference_loads_the_decoders_state_dict_strictly(gate, deep_output, context_to_lstm):
    overrides = [
        f"model.gate={gate}",
        f"model.deep_output={str(deep_output).lower()}",
        f"model.context_to_lstm={str(context_to_lstm).lower()}",
    ]
    cfg, decoder = tiny_model(*overrides)
    ref = ReferenceDecoder(cfg, VOCAB, FEATURE_DIM).eval()
    state = decoder.state_dict()
    assert set(ref.state_dict()) == set(state)  # the checkpoint's keys, no more, no fewer
    missing = ref.load_state_dict(state)  # strict
    assert not missing.missing_keys and not missing.unexpected_keys
    features, tokens = tiny_data()
    with torch.no_grad():
        ours = decoder(features, tokens[:, :-1]).logits  # (B, T, V)
        theirs = ref(features, tokens[:, :-1]).logits
    assert (ours - theirs).abs().max() < 1e-5
    # its own weights: changing the reference leaves the decoder as it was
    with torch.no_grad():
        ref.out.bias.add_(1.0)
    assert torch.equal(decoder.out.bias, state["out.bias"])
    assert not torch.equal(ref.out.bias, state["out.bias"])


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
    theirs = reference_beam_search(
        reference_of(decoder), features, beam_size=beam_size, max_length=MAX_LENGTH
    )
    assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.equal(ours.lengths, theirs.lengths)
    assert torch.allclose(ours.scores.double(), theirs.scores.double(), atol=1e-6)
    assert torch.allclose(ours.alphas.float(), theirs.alphas, atol=1e-6)
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
    theirs = reference_greedy(reference_of(decoder), features, max_length=MAX_LENGTH)
    assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.equal(ours.lengths, theirs.lengths)
    assert torch.allclose(ours.scores.double(), theirs.scores.double(), atol=1e-6)
    for row, length in enumerate(ours.lengths.tolist()):
        steps = min(length + 1, MAX_LENGTH)  # the words and the <end> step
        assert torch.allclose(ours.alphas[row, :steps].float(), theirs.alphas[row, :steps])
    # beam search with one beam is greedy decoding, in the reference too
    one_beam = reference_beam_search(
        reference_of(decoder), features, beam_size=1, max_length=MAX_LENGTH
    )
    assert torch.equal(one_beam.lengths, theirs.lengths)
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
    theirs = reference_beam_search(reference_of(decoder), features, beam_size=2, max_length=6)
    assert ours.tokens.tolist() == theirs.tokens.tolist() == [[A, D, 0]] * 3
    assert torch.allclose(theirs.scores, torch.tensor(math.log(0.5 * 0.98 * 0.9)), atol=1e-4)
    assert torch.allclose(ours.scores.double(), theirs.scores.double(), atol=1e-6)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.attention=hard", "soft attention"),
        ("model.attention=none", "soft attention"),
        ("model.score=general", "additive and additive_relu scores"),
        ("model.score=dot", "additive and additive_relu scores"),
    ],
)
def test_reference_refuses_what_it_does_not_implement(override, message):
    cfg = load_config(None, [*TINY, override]).model
    with pytest.raises(ValueError, match=message):
        ReferenceDecoder(cfg, VOCAB, FEATURE_DIM)


def test_reference_beam_search_refuses_a_length_penalty():
    features, _ = tiny_data()
    with pytest.raises(ValueError, match="length_penalty"):
        reference_beam_search(reference_of(tiny_decoder()), features, length_penalty=0.7)


def test_check_reference_reports_a_wrong_reference(monkeypatch):
    def drops_a_word(*args, **kwargs):
        decoded = reference_beam_search(*args, beam_size=5, **kwargs)
        decoded.lengths = decoded.lengths - 1
        return decoded

    features, tokens = tiny_data()
    cfg, decoder = tiny_model()
    good = check_reference(decoder, cfg, features, tokens, MAX_LENGTH, torch.device("cpu"))
    assert good["passed"] and good["logits_max_abs_diff"] < 1e-5
    beam5 = reference_decoding.DECODERS["beam5"]
    monkeypatch.setitem(reference_decoding.DECODERS, "beam5", (beam5[0], drops_a_word))
    bad = check_reference(decoder, cfg, features, tokens, MAX_LENGTH, torch.device("cpu"))
    assert not bad["passed"]
    assert bad["captions"]["random"]["beam5"]["equal_share"] == 0.0
    assert bad["captions"]["random"]["beam3"]["equal_share"] == 1.0


# --------------------------------------------------------------------------- what is timed


def test_timed_steps_and_decoding_are_the_packages_own(tmp_path, monkeypatch):
    assert workload.train_step is training_step.train_step
    assert workload.caption_batch is inference.caption_batch
    steps, decodes, compiled = [], [], []

    def counting_step(run, module, batch, device):
        steps.append(
            {
                "decoder": type(run.model.decoder).__name__,
                "inputs": sorted(batch),
                "precision": run.cfg.train.precision,
                "compiled": module is not run.model,
                "training": run.model.training,
            }
        )
        return training_step.train_step(run, module, batch, device)

    def counting_caption_batch(model, settings, precision, images=None, grid=None):
        decodes.append((settings, precision, images is None and grid is not None, model.training))
        return inference.caption_batch(model, settings, precision, images=images, grid=grid)

    def eager_compile(fn, **kwargs):
        def run_eagerly(*args, **kw):
            compiled.append(fn)
            return fn(*args, **kw)

        return run_eagerly

    monkeypatch.setattr(workload, "train_step", counting_step)
    monkeypatch.setattr(workload, "caption_batch", counting_caption_batch)
    monkeypatch.setattr(torch, "compile", eager_compile)
    options = bench.BenchOptions(
        sizes=["tiny"],
        device="cpu",
        precisions=["bf16"],
        compile=True,
        quick=True,
        quiet=True,
        out=str(tmp_path / "bench.json"),
    )
    results = bench.run_benchmark(options)
    assert all(m["error"] is None for m in results["measurements"])

    # one warm-up and one timed run of each: reference, ours and ours compiled
    assert all(s["precision"] == "bf16" and s["training"] for s in steps)
    theirs, ours, ours_compiled = (
        ("ReferenceDecoder", False),
        ("Decoder", False),
        ("Decoder", True),
    )
    decoder_steps = [
        (s["decoder"], s["compiled"]) for s in steps if s["inputs"] == ["grid", "tokens"]
    ]
    assert decoder_steps == [theirs] * 2 + [ours] * 2 + [ours_compiled] * 2
    full_steps = [
        (s["decoder"], s["compiled"]) for s in steps if s["inputs"] == ["images", "tokens"]
    ]
    assert full_steps == [ours] * 2 + [ours_compiled] * 2
    assert len(steps) == len(decoder_steps) + len(full_steps)

    # ours decodes through caption_batch, every caption to max_length, eager and compiled
    assert len(decodes) == 3 * 2 * 2
    for settings, precision, from_grid, training in decodes:
        assert settings.max_length == settings.min_length == MAX_LENGTH
        assert precision == "bf16" and from_grid and not training
    strategies = [(s.strategy, s.beam_size) for s, *_ in decodes[:6]]
    assert strategies[::2] == [("greedy", 3), ("beam", 3), ("beam", 5)]  # greedy ignores K
    compiled_fns = {getattr(fn, "__name__", type(fn).__name__) for fn in compiled}
    assert compiled_fns == {"step", "Captioner"}  # decoder.step, and the trained captioner


# --------------------------------------------------------------------------- the script


def test_quick_run_writes_every_measurement(tmp_path, monkeypatch, capsys):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(torch, "compile", no_compiler)
    out, speed = tmp_path / "bench.json", tmp_path / "speed.json"
    speed.write_text(json.dumps([{"kind": "floor", "task": "beam5"}]))  # kept by the merge
    argv = ["--sizes", "tiny", "--quick", "--device", "cpu", "--compile", "--quiet"]
    assert bench.main([*argv, "--out", str(out), "--results", str(speed)]) == 0
    results = json.loads(out.read_text())
    rows = json.loads(speed.read_text())
    assert rows[0] == {"kind": "floor", "task": "beam5"}
    assert len(rows) == 1 + len(results["measurements"])
    assert [r["median_s"] for r in rows[1:]] == [m["median_s"] for m in results["measurements"]]
    assert all(
        r["kind"] == "bench"
        and r["checks_passed"]
        and r["timed_alone"]
        and r["commit"]
        and r["precision"]
        and r["threads"] == 1
        and r["machine"]["device"]
        for r in rows[1:]
    )
    # the command is the module form and names no path of this machine
    assert {r["command"] for r in rows[1:]} == {
        "python -m benchmarks.bench " + " ".join(argv) + " --out OUT/bench.json --results "
        "OUT/speed.json"
    }
    # a re-run replaces its rows (same host, size, device, precision, compilation, task, impl)
    rerun = [*argv, "--precisions", "fp32", "--skip-cider", "--machine-busy"]
    assert bench.main([*rerun, "--out", str(tmp_path / "b2.json"), "--results", str(speed)]) == 0
    again = json.loads(speed.read_text())
    assert len(again) == len(rows)
    fp32 = [r for r in again if r.get("precision") == "fp32"]
    assert fp32 and not any(r["timed_alone"] for r in fp32)
    assert all(r["timed_alone"] for r in again if r.get("precision") == "bf16")
    table = load_tool("tables").speed_bench(again)
    host = rows[1]["machine"]["device"]
    assert (
        f"| tiny | cpu: {host} | fp32 | beam5 |" in table and "a machine doing other work" in table
    )
    # rows of other settings replace the file's rows only when asked
    other = {**results, "settings": {**results["settings"], "seed": 1}}
    with pytest.raises(ResultsError, match="made with other settings; re-run with --replace"):
        bench_report.record_timings(speed, other, argv, timed_alone=True)
    assert json.loads(speed.read_text()) == again
    bench_report.record_timings(speed, other, argv, timed_alone=True, replace=True)
    assert {r["settings"]["seed"] for r in json.loads(speed.read_text())[1:]} == {1}
    # another host's rows stay beside this host's, each in its own line of the table
    elsewhere = [
        {**r, "machine": {**r["machine"], "device": "Another CPU"}} if "machine" in r else r
        for r in json.loads(speed.read_text())
    ]
    speed.write_text(json.dumps(elsewhere))
    bench_report.record_timings(speed, results, argv, timed_alone=True)
    merged = json.loads(speed.read_text())
    assert len(merged) == len(elsewhere) + len(results["measurements"])
    table = load_tool("tables").speed_bench(merged)
    assert f"| tiny | cpu: {host} | fp32 | beam5 |" in table
    assert "| tiny | cpu: Another CPU | fp32 | beam5 |" in table
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
    cider = results["cider"]
    assert cider["corpus_images"] == 200 and cider["candidates"] == 64 * 5
    assert cider["ours_s"] > 0 and cider["speedup"] == cider["pycocoevalcap_s"] / cider["ours_s"]
    assert cider["max_abs_diff"] < 1e-9
    assert {(r["precision"], r["task"]) for r in results["speedups"]} == {
        (precision, task)
        for precision in ("fp32", "bf16")
        for task in ("decoder_step", "greedy", "beam3", "beam5")
    }

    table = capsys.readouterr().out
    assert "| tiny | cpu | fp32 | beam k=5 | ours |" in table
    assert out.with_suffix(".md").read_text().startswith("# Benchmark")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--sizes", "tiny,huge"],
            "--sizes must name some of shapes, coco, flickr8k, flickr8k_14x14, tiny",
        ),
        (["--sizes", ","], "--sizes must name some of"),
        (["--precisions", "fp16"], "--precisions must name fp32 and/or bf16"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--warmup", "-1"], "--warmup must be at least 0"),
        (["--repeats", "many"], "argument --repeats: invalid int value"),
        (["--device", "gpu"], "argument --device: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    assert bench.main([*args, "--out", str(tmp_path / "b.json")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert captured.out == "" and not (tmp_path / "b.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_one_line_error(tmp_path, capsys):
    assert (
        bench.main(["--sizes", "tiny", "--device", "cuda", "--out", str(tmp_path / "b.json")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "CUDA" in err and "\n" not in err


def test_a_failed_reference_check_exits_1(tmp_path, monkeypatch, capsys):
    def failing_check(*args, **kwargs):
        return {**check_reference(*args, **kwargs), "passed": False}

    monkeypatch.setattr(bench, "check_reference", failing_check)
    monkeypatch.setattr(bench, "_time_device", lambda *args, **kwargs: [])  # no timings
    out = tmp_path / "bench.json"
    argv = ["--sizes", "tiny", "--quick", "--device", "cpu", "--quiet", "--out", str(out)]
    assert bench.main(argv) == 1
    captured = capsys.readouterr()
    assert "| NO |" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "error: ours and the reference disagree (see the checks table)"
    )
    assert json.loads(out.read_text())["passed"] is False


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_the_benchmarks_run_as_modules_from_the_repository_root():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    bench_run = run("benchmarks.bench", "--sizes", "nope")
    assert bench_run.returncode == 2
    assert bench_run.stderr.strip().splitlines() == [
        "error: --sizes must name some of shapes, coco, flickr8k, flickr8k_14x14, tiny; "
        "got ['nope']"
    ]
    modules = ("beam_floor", "profile_epoch", "roofline", "serve_load", "serve_stress")
    for module in (*modules, "train_floor", "allocator"):
        helped = run(f"benchmarks.{module}", "--help")
        assert helped.returncode == 0 and f"python -m benchmarks.{module}" in helped.stdout


# --------------------------------------------------------------------------- training floor


def test_the_training_floor_records_every_product_a_step_runs():
    from torch.utils.flop_counter import FlopCounterMode

    a, b, batched = torch.randn(4, 3), torch.randn(3, 5), torch.randn(2, 3, 6)

    def work():
        (a @ b).sum()
        a @ b
        torch.bmm(batched.transpose(1, 2), batched)

    products = train_floor.record_products(work)
    assert sorted(products.values()) == [1, 2]
    assert sum(p.gflop * n for p, n in products.items()) == pytest.approx(
        (2 * 2 * 4 * 3 * 5 + 2 * 2 * 6 * 3 * 6) / 1e9
    )
    assert {p.label for p in products} == {"mm 4x3x5 fp32", "bmm 2x6x3x6 fp32"}

    # the tiny size's training step: the FLOPs torch's counter counts
    size = workload.SIZES["tiny"]()
    torch.manual_seed(0)
    model = build_model(size.config.model, size.vocab_size)
    setup = workload.set_up(size, model, workload.random_batch(size, model, 0), torch.device("cpu"))
    step = workload.decoder_step(setup, size.config, reference=False, compiled=False)
    step()
    recorded = train_floor.record_products(step)
    with FlopCounterMode(display=False) as counter:
        step()
    matrix = {p: n for p, n in recorded.items() if p.op not in ("mv", "addmv")}
    gflop = sum(p.gflop * n for p, n in matrix.items())
    assert gflop == pytest.approx(counter.get_total_flops() / 1e9, rel=1e-9) and gflop > 0
    assert any(p.op == "bmm" for p in recorded)  # the context, forward and backward
    times = train_floor.time_products(recorded, repeats=1)
    assert times.keys() == recorded.keys() and min(times.values()) > 0


def test_the_training_floor_row_bounds_the_speed_up(tmp_path, capsys):
    from lab.provenance import record

    results = tmp_path / "speed.json"
    other = {"kind": "profile", "run": "a row of another benchmark"}
    record(
        results, [other], lambda r: r["kind"], module="m", argv=[], timed_alone=True, settings=()
    )
    args = ["--sizes", "tiny", "--rounds", "2", "--repeats", "1", "--results", str(results)]
    assert train_floor.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny fp32: ") and f"merged 1 rows into {results}" in out
    kept, row = json.loads(results.read_text())
    assert kept["run"] == other["run"]
    assert row["kind"] == "train_floor" and row["size"] == "tiny" and row["rounds"] == 2
    assert min(row["floor_seconds"], row["ours_seconds"], row["reference_seconds"]) > 0
    assert len(row["ours_over_floor"]) == len(row["reference_over_floor"]) == 2
    allowed = row["reference_seconds"] / row["floor_seconds"]
    assert f"at most {allowed:.1f}x it" in out
    assert row["command"] == (  # no machine paths
        "python -m benchmarks.train_floor --sizes tiny --rounds 2 --repeats 1 "
        "--results OUT/speed.json"
    )
    # another host's row stays beside this host's, and the table names both
    results.write_text(json.dumps([{**row, "device": "Another CPU"}]))
    assert train_floor.main(args) == 0
    rows = json.loads(results.read_text())
    assert sorted(r["device"] for r in rows) == sorted(["Another CPU", row["device"]])
    table = load_tool("tables").speed_train_floor(rows)
    assert "| Another CPU | tiny | fp32 |" in table and f"| {row['device']} | tiny |" in table
    with pytest.raises(SystemExit) as exited:
        train_floor.main(["--sizes", "tiny,huge"])
    assert exited.value.code == 2
    assert "unknown or no size or precision: huge" in capsys.readouterr().err


# --------------------------------------------------------------------------- allocator


def test_the_allocator_benchmark_alternates_the_two_processes(tmp_path, capsys, monkeypatch):
    order = []

    def in_a_fresh_process(size, precision, mode, repeats):
        order.append(mode)
        assert (size, precision) == ("tiny", "fp32") and repeats in (3, 4)
        return {"seconds": 0.3 if mode == "default" else 0.1 * len(order), "faults": 7.0}

    monkeypatch.setattr(allocator, "_in_a_fresh_process", in_a_fresh_process)
    results = tmp_path / "speed.json"
    args = ["--sizes", "tiny", "--rounds", "3", "--repeats", "3", "--results", str(results)]
    assert allocator.main(args) == 0
    assert order == ["default", "kept", "kept", "default", "default", "kept"]
    order.clear()
    (row,) = json.loads(results.read_text())
    assert row["kind"] == "allocator" and row["default_seconds"] == [0.3] * 3
    assert row["kept_seconds"] == pytest.approx([0.2, 0.3, 0.6])
    assert row["speedups"] == pytest.approx([1.5, 1.0, 0.5])
    assert row["command"] == (  # no machine paths
        "python -m benchmarks.allocator --sizes tiny --rounds 3 --repeats 3 "
        "--results OUT/speed.json"
    )
    out = capsys.readouterr().out
    assert "tiny fp32: 0.3 s with glibc's default (7 page faults a step)" in out
    assert "1.00x (rounds 0.50-1.50x)" in out
    # a row of other settings (more repeats) is not replaced unless asked: one line, exit 2
    written = results.read_text()
    again = [*args[:-3], "4", "--results", str(results)]
    assert allocator.main(again) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("error: ") and results.read_text() == written
    assert allocator.main([*again, "--replace"]) == 0
    assert json.loads(results.read_text())[0]["repeats"] == 4
    with pytest.raises(SystemExit) as exited:
        allocator.main(["--sizes", "tiny,huge"])
    assert exited.value.code == 2
    assert "unknown or no size or precision: huge" in capsys.readouterr().err


def test_the_allocator_benchmark_times_steps_and_counts_their_faults():
    timed = allocator.time_steps("tiny", "fp32", "default", repeats=2)
    assert timed["seconds"] > 0 and timed["faults"] >= 0


@pytest.mark.slow  # two fresh processes
def test_the_allocator_benchmarks_child_processes_report_their_steps():
    for mode in allocator.MODES:
        timed = allocator._in_a_fresh_process("tiny", "fp32", mode, 2)
        assert timed["seconds"] > 0 and timed["faults"] >= 0
    with pytest.raises(SystemExit, match="the kept step of nope fp32 failed: KeyError"):
        allocator._in_a_fresh_process("nope", "fp32", "kept", 2)


# --------------------------------------------------------------------------- beam floor


@pytest.mark.slow  # times beam search against its floor
def test_beam_floor_bounds_the_speed_up_from_a_bench_file(tmp_path, capsys):
    results = {
        "measurements": [
            {
                "size": "coco",
                "device": "cpu",
                "precision": "fp32",
                "task": "beam2",
                "impl": "reference",
                "median_s": 1000.0,
            },
            {
                "size": "coco",
                "device": "cpu",
                "precision": "fp32",
                "task": "beam2",
                "impl": "ours",
                "compiled": False,
                "median_s": 30.0,
            },
            {
                "size": "coco",
                "device": "cpu",
                "precision": "fp32",
                "task": "greedy",
                "impl": "reference",
                "median_s": 500.0,
            },
        ]
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results))
    args = ["--beam-size", "2", "--images", "2", "--max-length", "2", "--repeats", "1"]
    assert beam_floor.main([*args, "--no-compile", "--bench", str(path)]) == 0
    out = capsys.readouterr().out
    dense = float(out.split("dense layers:")[1].split(" s")[0])
    # the fastest form of the few-row products, torch's own among them
    # the fastest of the forms of the few-row products, each printed (3 digits)
    by_form = [
        float(out.split(f"dense layers, {form}:")[1].split(" s")[0])
        for form in ("torch's own", "transposed", "packed")
        if f"dense layers, {form}:" in out
    ]
    assert len(by_form) >= 2 and dense == pytest.approx(min(by_form), rel=0.01)
    passes = [
        float(out.split(f"eager {name}:")[1].split(" s")[0])
        for name in ("add", "tanh", "sigmoid", "projection")
    ]
    sequence = float(out.split("eager, in sequence:")[1].split(" s")[0])
    choice = float(out.split("word choice:")[1].split(" s")[0])
    # 2 images, first word on 1 beam, second on 2: 2 * 3 * 196 * 512 activations
    assert f"{2 * 3 * 196 * 512 / 1e6:.0f}M values" in out
    assert dense > 0 and min(passes) > 0
    bound = float(out.split("at most ")[1].split("x")[0])
    # the eager floor: each word's dense layers, score passes and word choice run in turn,
    # about the sum of those parts timed alone
    assert sequence > 0 and choice > 0
    # the score as one C kernel where it is built: the floor takes the faster form
    score = sequence
    if fused_score.available(torch.zeros(1, 1, 1, 1)):
        score = min(score, float(out.split("score, one C kernel:")[1].split(" s")[0]))
    floor = float(out.split("floor, eager (each word's parts in turn): ")[1].split(" s")[0])
    assert 0.5 < floor / (dense + score + choice) < 3
    assert bound == pytest.approx(1000.0 / floor, rel=0.02)
    assert "20x the reference needs 50 s" in out
    # ours from the same file, as a multiple of the floor
    ratio = float(out.split("ours in that run 30 s, ")[1].split("x the floor")[0])
    assert ratio == pytest.approx(30.0 / floor, rel=0.02)

    # one beam is greedy decoding: its reference is the greedy one
    assert (
        beam_floor.main([*args[2:], "--beam-size", "1", "--no-compile", "--bench", str(path)]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("greedy, 2 images") and "the reference's 500.00 s" in out
    assert "ours" not in out  # the file has no time of ours for greedy

    # --ours times our greedy decoding right after each round of the floor
    speed = tmp_path / "speed.json"
    assert (
        beam_floor.main(
            [
                *args[2:],
                "--beam-size",
                "1",
                "--no-compile",
                "--ours",
                "--rounds",
                "2",
                "--results",
                str(speed),
            ]
        )
        == 0
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("floor, eager"))
    rounds = [float(x) for x in line.split("(rounds: ")[1].rstrip(")").split(", ")]
    assert len(rounds) == 2 and min(rounds) > 0
    (row,) = json.loads(speed.read_text())  # the row holds what was printed
    assert row["kind"] == "floor" and row["task"] == "greedy" and row["rounds"] == 2
    assert row["precision"] == "fp32" and row["threads"] and row["device"]
    assert row["command"].startswith("python -m benchmarks.beam_floor --images 2")
    assert str(tmp_path) not in row["command"]
    assert [f"{r:.2f}" for r in row["ratios_eager"]] == [f"{r:.2f}" for r in rounds]
    assert f"{row['floor_eager']:.3g} s" in line and "floor_compiled" not in row
    table = load_tool("tables").speed_floor([row])
    assert "| greedy, eager |" in table and f"**{row['floor_eager']:.3g} s**" in table
    assert f"| host | {row['device']} |" in table
    # another host's row stays beside this host's
    speed.write_text(json.dumps([{**row, "device": "Another CPU"}]))
    floor_args = [*args[2:], "--beam-size", "1", "--no-compile", "--results", str(speed)]
    assert beam_floor.main(floor_args) == 0
    assert sorted(r["device"] for r in json.loads(speed.read_text())) == sorted(
        ["Another CPU", row["device"]]
    )
    with pytest.raises(SystemExit):  # no such decoder among ours
        beam_floor.main([*args[2:], "--beam-size", "4", "--ours"])
    assert "--ours times greedy, beam3, beam5" in capsys.readouterr().err

    # a bench file without that reference is a one-line error
    assert beam_floor.main([*args, "--no-compile", "--bench", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "run `python -m benchmarks.bench --sizes coco` first" in err


def test_profile_epoch_splits_the_step_into_phases(tmp_path, capsys):
    """The epoch profile trains real steps of the config: every phase is timed, the phases
    add up to the step, and the epoch estimate is steps x step + validation."""
    from benchmarks import profile_epoch
    from captioning.data.shapes import generate_shapes

    generate_shapes(tmp_path / "shapes", num_train=16, num_val=4, num_test=4, image_size=48)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "test_tiny.yaml")
    out = tmp_path / "profile.json"
    speed = tmp_path / "speed.json"
    code = profile_epoch.main(
        [
            "--config",
            config,
            "--set",
            f"data.root={tmp_path / 'shapes'}",
            "--steps",
            "3",
            "--out",
            str(out),
            "--results",
            str(speed),
            "--machine-busy",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    (row,) = json.loads(speed.read_text())
    assert row["kind"] == "profile" and row["phases"] == result["phases"]
    assert row["timed_alone"] is False and row["precision"] == "fp32" and row["threads"]
    # the row runs anywhere: the config inside the checkout, no path of this machine
    assert row["config"] == "configs/test_tiny.yaml"
    assert row["command"].startswith("python -m benchmarks.profile_epoch --config configs/")
    assert str(tmp_path) not in json.dumps(row) and row["machine"]["device"]
    table = load_tool("tables").speed_profile([row])
    assert f"**{result['step_seconds'] * 1e3:.0f}**" in table and "a machine doing other" in table
    # another host's row of the same config stays beside it, its column naming its host
    speed.write_text(json.dumps([{**row, "device": "Another CPU"}]))
    argv = ["--config", config, "--set", f"data.root={tmp_path / 'shapes'}", "--steps", "3"]
    assert profile_epoch.main([*argv, "--results", str(speed), "--machine-busy"]) == 0
    both = json.loads(speed.read_text())
    assert sorted(r["device"] for r in both) == sorted(["Another CPU", row["device"]])
    assert "Another CPU" in load_tool("tables").speed_profile(both).splitlines()[0]
    phases = result["phases"]
    assert list(phases) == list(profile_epoch.PHASES)
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert math.isclose(sum(phases.values()), result["step_seconds"], rel_tol=0.5)
    validation = result["validation_decode_seconds"] + result["validation_score_seconds"]
    expected = result["steps_per_epoch"] * result["step_seconds"] + validation
    assert math.isclose(result["epoch_seconds"], expected, rel_tol=1e-9)
    assert "| encoder backward |" in capsys.readouterr().out


@pytest.mark.slow
def test_profile_epoch_compiled_matches_the_eager_loss(tmp_path, capsys):
    """--compile times whole steps of the compiled model after its compilation, and one
    batch's loss through the compiled model equals the eager one. The graph is traced by
    TorchDynamo and AOTAutograd as for inductor, but run by the eager backend: inductor's
    C++ code generation would take minutes on a small CPU."""
    from benchmarks import profile_epoch
    from captioning.data.shapes import generate_shapes

    generate_shapes(tmp_path / "shapes", num_train=16, num_val=4, num_test=4, image_size=48)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "test_tiny.yaml")
    out = tmp_path / "profile.json"
    code = profile_epoch.main(
        [
            "--config",
            config,
            "--set",
            f"data.root={tmp_path / 'shapes'}",
            "--set",
            "model.dropout=0",
            "--steps",
            "2",
            "--compile",
            "--backend",
            "aot_eager",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["compiled"] and result["compile_warmup_seconds"] > 0
    assert result["compiled_loss_difference"] < 1e-4
    assert list(result["phases"]) == ["data", "forward, backward, optimiser"]
    assert "torch.compile" in capsys.readouterr().out


@pytest.mark.slow  # six short trainings in subprocesses
def test_two_jobs_times_each_arrangement_of_the_cores(tmp_path, monkeypatch):
    """One job alone, then the jobs on every core each, then sharing them: one row each with
    every job's steps per second; the table sets each sum against the job alone."""
    from benchmarks import two_jobs
    from captioning.data.shapes import generate_shapes

    generate_shapes(tmp_path / "shapes", num_train=16, num_val=4, num_test=4, image_size=48)
    monkeypatch.setattr(two_jobs.os, "sched_getaffinity", lambda pid: {0, 1})
    config = str(Path(__file__).resolve().parent.parent / "configs" / "test_tiny.yaml")
    speed = tmp_path / "speed.json"
    code = two_jobs.main(
        [
            "--config",
            config,
            "--set",
            f"data.root={tmp_path / 'shapes'}",
            "--steps",
            "2",
            "--results",
            str(speed),
        ]
    )
    assert code == 0
    rows = json.loads(speed.read_text())
    assert [(r["jobs"], r["threads"]) for r in rows] == [(1, 2), (2, 2), (2, 1)]
    for row in rows:
        assert len(row["steps_per_s"]) == row["jobs"] and all(s > 0 for s in row["steps_per_s"])
        assert row["steps_per_s_total"] == pytest.approx(sum(row["steps_per_s"]), abs=0.01)
        assert row["precision"] == "fp32" and row["commit"] and row["device"]
        assert str(tmp_path) not in str(row)
    table = load_tool("tables").speed_sharing(rows)
    assert f"| {rows[0]['device']} | 1 | 2 | " in table and "| 1.00x |" in table
    assert "| 2 | 1 | " in table
    # another host's rows stay beside these, each against its own host's job alone
    speed.write_text(json.dumps([{**r, "device": "Another CPU"} for r in rows]))
    again = ["--config", config, "--set", f"data.root={tmp_path / 'shapes'}", "--steps", "2"]
    assert two_jobs.main([*again, "--results", str(speed)]) == 0
    both = json.loads(speed.read_text())
    assert sorted({r["device"] for r in both}) == sorted({"Another CPU", rows[0]["device"]})
    assert load_tool("tables").speed_sharing(both).count("| 1.00x |") == 2


def test_the_encoder_benchmark_times_both_encoders_and_checks_their_grids(tmp_path):
    """One row per grid and precision with both times, their ratio and whether the joined
    convolutions give the grid the separate ones give; the table names each grid's shape."""
    from benchmarks import encoder_speed

    speed = tmp_path / "speed.json"
    argv = ["--images", "2", "--batch", "1", "--rounds", "1", "--precisions", "fp32"]
    assert encoder_speed.main([*argv, "--results", str(speed), "--machine-busy"]) == 0
    rows = json.loads(speed.read_text())
    assert [(r["grid"], r["precision"]) for r in rows] == [("best", "fp32"), ("os16", "fp32")]
    for row in rows:
        assert row["seconds_apart"] > 0 and row["seconds_fused"] > 0
        assert row["speedup"] == pytest.approx(row["seconds_apart"] / row["seconds_fused"], 0.01)
        assert row["max_abs_difference"] < 1e-3 and row["timed_alone"] is False
    assert [r["grid_shape"] for r in rows] == [[7, 7], [14, 14]]
    table = load_tool("tables").speed_encoder(rows)
    assert "| best (7x7 x 1,280) | fp32 | 2 |" in table
    assert "| os16 (14x14 x 320) | fp32 | 2 |" in table
    with pytest.raises(SystemExit) as exit_:
        encoder_speed.main(["--grids", "vgg"])
    assert exit_.value.code == 2


# --------------------------------------------------------------------------- roofline


def test_the_roofline_counts_a_products_flops_and_rates_it_against_the_peak():
    from benchmarks import roofline

    a, b = torch.randn(6, 5), torch.randn(5, 7)
    assert roofline.flops(lambda: torch.mm(a, b)) == 2 * 6 * 5 * 7
    rate = roofline.matmul_rate(64, 64, 64, "fp32", repeats=1)
    assert 0 < rate < 1e5  # GFLOP/s of a real product, not a count


@pytest.mark.slow  # a COCO-size model, every task timed once
def test_the_roofline_writes_a_row_per_task(tmp_path):
    from benchmarks import roofline

    results = tmp_path / "roofline.json"
    argv = ["--precisions", "fp32", "--images", "1", "--repeats", "1", "--results", str(results)]
    assert roofline.main(argv) == 0
    rows = json.loads(results.read_text())
    assert [row["task"] for row in rows] == list(roofline.TASKS)
    kernel = fused_score.available(torch.zeros(1, 1, 1, 1))
    for row in rows:
        assert row["gflop"] > 0 and 0 < row["share_of_square_peak"] < 2, row
        assert (row["seconds_torch_score"] is not None) == kernel  # timed in torch's form too


def test_the_roofline_counts_the_bytes_a_decoding_step_must_read():
    """Every weight matrix a step multiplies by, counted once, and the grid and its keys;
    not the embedding table (a step reads a row of it), the initial state's layers or the
    key projection (run once per caption)."""
    from benchmarks import roofline

    torch.manual_seed(0)
    model = build_model(load_config("configs/test_tiny.yaml").model, 30).eval()
    with torch.no_grad():
        size = model.encoder.image_size
        features = model.encode(torch.randn(1, 3, size, size))
        keys = model.decoder.prepare(features)
    skipped = ("embedding.", "init_h.", "init_c.", "attention.score.key_proj.")
    weights = [
        p.numel()
        for name, p in model.decoder.named_parameters()
        if p.dim() == 2 and not name.startswith(skipped)
    ]
    assert len(weights) >= 6  # query, score, gate, the cell's two, the deep output's three
    expected = 4 * (sum(weights) + features.numel() + keys.numel())
    assert roofline.step_bytes(model.decoder, features, "fp32") == expected
    assert roofline.step_bytes(model.decoder, features, "bf16") == expected // 2
