"""Draw the attention mask of one packed sample: which keys each query sees under --reset-attention-mask.

    python tools/plot_mask.py DATA_PREFIX --sample N --out FILE.png [--seq-length S] [--seed S] [--split 969,30,1]
        [--tokenizer-model FILE | --tokenizer-type T ... | --tokenizer-type NullTokenizer --vocab-size N]
        [--window-size L,0]

Sample N is the train split's as a run with this --seq-length, --seed and --split cuts and orders it
(engine/data/gpt_dataset.py; a run that reads more than one epoch orders its samples over all of them, so this
is the sample a run reading one epoch or less draws at N). Its documents are read off the tokenizer's
end-of-document token as the trainer's door reads them (engine/documents.py), and the picture is the mask the
attention kernels apply (engine/attention_mask.py, kernels/reference.py's `visible`): each document's causal
triangle in a colour of its own, the pairs that --reset-attention-mask removes (causal, across documents) in
light grey, the rest white; a window (--window-size) narrows each triangle to a band. The strip above marks the
tokens whose loss --eod-mask-loss drops (their input is the EOD) and the title gives the documents' lengths
and their attention pairs (sum of L_i^2, as the FLOP count takes them) against the whole sample's s^2.
Exit codes: 0 written, 2 a mistake (one line).
"""
from __future__ import annotations

import argparse
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap

from engine.attention_mask import AttentionMask
from engine.cli import parse_config
from engine.config import ConfigError
from engine.data import build_datasets
from engine.data.tokenizer_spec import tokenizer_of
from engine.documents import Packing
from engine.resolve import resolve
from kernels import reference

CROSSING, HIDDEN = 1, 0  # image values below the documents' (2, 3, ...)


def sample_tokens(args) -> tuple:
    """(tokens [s] of sample --sample, the EOD id) from the data and tokenizer flags."""
    flags = ["--data-path", args.data_prefix, "--seq-length", str(args.seq_length), "--max-position-embeddings",
             str(args.seq_length), "--seed", str(args.seed), "--split", args.split]
    for name in ("tokenizer_model", "tokenizer_type", "vocab_file", "merge_file", "vocab_size"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cfg = resolve(parse_config(flags), 1)
    spec = tokenizer_of(cfg)
    eod = spec.build().eod if spec is not None else None
    if eod is None:
        raise ConfigError(f"{args.data_prefix}: give the tokenizer the data was made with (--tokenizer-model FILE, "
                          "or --tokenizer-type and its files): its end-of-document token ends the documents")
    train = build_datasets(cfg, args.sample + 1, 0, 0, log=lambda line: None)[0]
    return torch.from_numpy(np.asarray(train[args.sample][:-1], dtype=np.int64)), eod


def mask_image(tokens: torch.Tensor, eod: int, window) -> tuple:
    """([s, s] image values: HIDDEN, CROSSING, or 2 + the document's index where visible; the documents)."""
    _, documents = Packing(eod, reset_attention_mask=True).apply(tokens[None])
    s, positions = tokens.shape[0], torch.arange(tokens.shape[0])
    seen = reference.visible(positions, positions, True, window, documents.bounds)[0]
    causal = reference.visible(positions, positions, True, window)
    index = torch.from_numpy(np.cumsum(documents.first[0] == np.arange(s)) - 1)  # each position's document
    image = torch.where(seen, 2 + index[:, None], torch.where(causal, CROSSING, HIDDEN))
    return image.numpy(), documents


def draw(tokens: torch.Tensor, eod: int, window, sample: int, out: str) -> str:
    """Write the picture; returns its title."""
    image, documents = mask_image(tokens, eod, window)
    lengths, s = documents.lengths()[0], tokens.shape[0]
    mask = AttentionMask(window=window)
    pairs = mask.counted_pairs(lengths)
    palette = plt.get_cmap("tab20").colors
    cmap = ListedColormap(["white", "#dddddd"] + [palette[i % len(palette)] for i in range(len(lengths))])
    fig, (strip, ax) = plt.subplots(2, 1, figsize=(7, 7.6), gridspec_kw={"height_ratios": [1, 24]}, sharex=True)
    strip.imshow((tokens == eod).numpy()[None].astype(float), cmap=ListedColormap(["white", "black"]),
                 aspect="auto", interpolation="nearest", extent=(-0.5, s - 0.5, 0, 1))
    strip.set_yticks([])
    strip.set_ylabel("no loss", rotation=0, ha="right", va="center", fontsize=8)
    ax.imshow(image, cmap=cmap, vmin=0, vmax=len(lengths) + 1, interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ends = np.cumsum(lengths)[:-1] - 0.5
    for end in ends:
        ax.axhline(end, color="black", linewidth=0.4)
        ax.axvline(end, color="black", linewidth=0.4)
    shown = ", ".join(map(str, lengths[:12])) + (", ..." if len(lengths) > 12 else "")
    title = (f"sample {sample}: {len(lengths)} documents ({shown}); attention pairs {pairs:,} of "
             f"{mask.counted_pairs([s]):,} ({pairs / mask.counted_pairs([s]):.0%})")
    strip.set_title(title + "\ncolour: visible within a document; grey: causal pairs across documents, removed",
                    fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return title


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plot_mask.py", description=__doc__.split("\n")[0])
    p.add_argument("data_prefix", help="an indexed dataset (PREFIX.bin/.idx, made by tools/preprocess_data.py)")
    p.add_argument("--sample", type=int, default=0, help="which train sample (default 0)")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--seed", type=int, default=1234, help="the run's --seed (default 1234)")
    p.add_argument("--split", default="969,30,1", help="the run's --split (default 969,30,1)")
    p.add_argument("--window-size", help="a sliding window 'L,0' as the trainer takes it")
    for name in ("--tokenizer-model", "--tokenizer-type", "--vocab-file", "--merge-file"):
        p.add_argument(name, help="as the trainer takes it")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: ids below it are text, it is the EOD id")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.sample < 0:
            raise ConfigError(f"--sample {args.sample}: give a sample index (0 or more)")
        window = parse_config(["--mock-data", "--window-size", args.window_size]).model.attention_window(0) \
            if args.window_size else None
        tokens, eod = sample_tokens(args)
        print(draw(tokens, eod, window, args.sample, args.out))
    except ConfigError as e:
        print(f"plot_mask.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
