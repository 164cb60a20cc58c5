"""How the Flickr8k captions score when decoded otherwise than the recipe's 3 beams
(``results/flickr8k.json``): with the beam size and length penalty chosen on the dev split
(rows of ``benchmarks/flickr8k_decoding.py``), and cut to their first words, which shows
what BLEU without the brevity penalty rewards."""

from __future__ import annotations

from tools.tables.common import Rows, header, mean, source_note
from tools.tables.flickr8k import FLICKR8K_MODELS, RECIPE, _device, _last_gpu

DEV_DECODE = "dev_decode"  # benchmarks/flickr8k_decoding.py's variant for the recipe's runs


def decoded_variant(variant: str) -> str | None:
    """The variant of the runs a row of ``benchmarks/flickr8k_decoding.py`` decoded: its
    ``dev_decode`` rows are the recipe's, ``NAME_dev_decode`` rows those of lever ``NAME``;
    None for any other row."""
    if variant == DEV_DECODE:
        return RECIPE
    if variant.endswith("_" + DEV_DECODE):
        return variant[: -len(DEV_DECODE) - 1]
    return None


def flickr8k_dev_decode(rows: Rows) -> str:
    """Decoding chosen on the dev split (rows of ``benchmarks/flickr8k_decoding.py``) against
    3 beams on the same runs (the recipe's, or a lever's): the setting each seed's dev split
    chose, and the test scores' means in percent."""
    lines = header(
        "model | runs | trained on | seeds | chosen on the dev split: beams / length penalty "
        "(seed) | BLEU-4 | at 3 beams | METEOR | at 3 beams | CIDEr-D | at 3 beams | "
        "BLEU-4 of each seed | METEOR of each seed"
    )
    three = {
        (r["variant"], r["model"], r["seed"], _device(r)): r for r in rows if r["beam_size"] == 3
    }
    groups: dict[tuple, Rows] = {}
    for row in rows:
        runs = decoded_variant(row["variant"])
        if runs is not None and (runs, row["model"], row["seed"], _device(row)) in three:
            groups.setdefault((row["model"], runs, _device(row)), []).append(row)
    if not groups:
        return "No rows of `results/flickr8k.json` with decoding chosen on the dev split yet.\n"
    order = {m: i for i, m in enumerate(FLICKR8K_MODELS)}
    for (model, runs, device), group in sorted(
        groups.items(),
        key=lambda g: (order[g[0][0]], g[0][1] != RECIPE, g[0][1], _last_gpu(g[0][2])),
    ):
        group = sorted(group, key=lambda r: r["seed"])
        base = [three[runs, model, r["seed"], device] for r in group]
        chosen = ", ".join(
            f"{r['decode']['beam_size']} / {r['decode']['length_penalty']:g} ({r['seed']})"
            for r in group
        )
        cells = [
            f"{100 * mean([r[k] for r in g]):.2f}"
            for k in ("Bleu_4", "METEOR", "CIDEr")
            for g in (group, base)
        ]
        each = " | ".join(
            ", ".join(f"{100 * r[k]:.2f} ({r['seed']})" for r in group)
            for k in ("Bleu_4", "METEOR")
        )
        lines.append(
            f"| {model} | {runs} | {device} | {len(group)} | {chosen} | "
            + " | ".join(cells)
            + f" | {each} |"
        )
    shown = [r for group in groups.values() for r in group]
    return "\n".join([*lines, "", source_note(shown, "flickr8k")]) + "\n"


def flickr8k_brevity(rows: Rows) -> str:
    """What BLEU without the brevity penalty rewards: the soft model's beam-3 test captions
    as decoded and cut to their first N words (variants ``cutN``), scored both ways."""
    lines = header(
        "captions | runs | words per caption | length ratio | brevity penalty | BLEU-1 | "
        "BLEU-1 without BP | BLEU-4 | BLEU-4 without BP | METEOR | CIDEr-D"
    )
    groups: dict[str, Rows] = {}
    for row in rows:
        cut = row["variant"].startswith("cut")
        if row["model"] == "soft" and row["beam_size"] == 3 and (cut or row["variant"] == RECIPE):
            groups.setdefault(row["variant"], []).append(row)
    for variant in sorted(groups, key=lambda v: -1000 if v == RECIPE else -int(v[3:])):
        group = groups[variant]
        name = "as decoded" if variant == RECIPE else f"first {variant[3:]} words"
        cells = [
            f"{mean([r['mean_words'] for r in group]):.1f}",
            *(
                f"{mean([r[k] for r in group]):.3f}"
                for k in ("Bleu_length_ratio", "Bleu_brevity_penalty")
            ),
            *(
                f"{100 * mean([r[k] for r in group]):.2f}"
                for k in ("Bleu_1", "Bleu_1_no_bp", "Bleu_4", "Bleu_4_no_bp", "METEOR", "CIDEr")
            ),
        ]
        lines.append(f"| {name} | {len(group)} | " + " | ".join(cells) + " |")
    shown = [r for group in groups.values() for r in group]
    return "\n".join([*lines, "", source_note(shown, "flickr8k")]) + "\n"
