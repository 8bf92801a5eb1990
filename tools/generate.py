"""Sample a continuation of a prompt from a trained model, on one process; prints the prompt and its continuation.

    python tools/generate.py --load DIR_OR_MERGED --prompt TEXT [--max-new-tokens N] [--top-k K]
                             [--temperature T] [--seed S] [--tokenizer-model FILE] [--device cpu|cuda]
                             [--tokenizer-type T] [--vocab-file F --merge-file F]

--load is a merged checkpoint (tools/merge_ckpt.py --format native: model.safetensors + config.json)
or a run's --save directory (its latest checkpoint is read directly, any layout). The model and
tokenizer settings come from the saved run config (any --tokenizer-type; a tokenizer file that moved is
also looked for beside the checkpoint); --tokenizer-model, --vocab-file and --merge-file override its files,
--tokenizer-type its type. With a NullTokenizer the prompt and the output are integer ids.
Top-k of 0 or 1 decodes greedily; otherwise the next token is drawn from the k most likely ones at the
given temperature, from a generator seeded with --seed. Generation stops after N tokens or at the end-
of-document token. Without a KV cache each step re-runs the (at most seq-length) context: fine for
checking a model, not for serving one.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import torch

from engine.cli import OneLineParser
from engine.config import TOKENIZER_TYPES, Config, ConfigError
from engine.data.tokenizer_spec import run_tokenizer_spec
from engine.model import GPTModel
from engine.parallel.topology import ParallelContext


def load_model(path: str, device: str = "cpu") -> tuple:
    """(model in eval mode, run Config, vocab size) from a merged checkpoint or a --save directory."""
    from engine.checkpoint import files, load_merged
    from engine.checkpoint.layout import local_tensors
    from engine.checkpoint.merged import MERGED_CONFIG, MERGED_WEIGHTS
    from engine.checkpoint.reader import open_iteration
    if not os.path.isdir(path):
        raise ConfigError(f"--load {path}: directory not found; give a merged checkpoint (tools/merge_ckpt.py "
                          "--out) or a run's --save directory")
    merged = os.path.isfile(os.path.join(path, MERGED_CONFIG))
    if merged:
        with open(os.path.join(path, MERGED_CONFIG)) as fh:
            saved = json.load(fh)
        run_config, vocab_size = saved.get("config"), saved.get("vocab_size")
        if not isinstance(run_config, dict) or not vocab_size:
            raise ConfigError(f"--load {path}: {MERGED_CONFIG} lacks the run config or vocab_size; "
                              "write it again with tools/merge_ckpt.py")
    elif files.read_latest(path) is not None or files.list_iterations(path):
        reader = open_iteration(path, choose="merge one with tools/merge_ckpt.py --iteration N and --load its --out")
        run_config, vocab_size = reader.meta.config, reader.meta.vocab_size
    else:
        raise ConfigError(f"--load {path}: holds neither a merged checkpoint ({MERGED_WEIGHTS} + {MERGED_CONFIG}) "
                          "nor a run's checkpoints (iter_NNNNNNN folders); give a tools/merge_ckpt.py --out folder "
                          "or a run's --save directory")
    cfg = Config.from_dict(run_config)
    ctx = ParallelContext()
    # Built with its random init on the device it runs on (not on the meta device: parameters keep the
    # specs the loaders read, and each attention layer resolves its backend for that device).
    model = GPTModel(cfg.model, ctx, vocab_size=vocab_size, device=device)
    if merged:
        load_merged(path, [model], ctx)
    else:
        with torch.no_grad():
            for lt in local_tensors([model], ctx):
                lt.param.copy_(reader.model_slice(lt.name, lt.full_shape, 1, 0, lt.param.dtype))
    return model.eval(), cfg, vocab_size


@torch.no_grad()
def generate(model, prompt: list, max_new_tokens: int, vocab_size: int, max_length: int, top_k: int = 0,
             temperature: float = 1.0, generator: Optional[torch.Generator] = None,
             stop_token: Optional[int] = None) -> list:
    """New token ids after `prompt` (greedy when top_k <= 1). The context is cut to the last max_length."""
    device = next(model.parameters()).device
    tokens, new = list(prompt), []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-max_length:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1, :vocab_size].float()  # columns past vocab_size are padding
        if top_k <= 1:
            nxt = int(logits.argmax())
        else:
            values, indices = torch.topk(logits / temperature, min(top_k, vocab_size))
            choice = torch.multinomial(torch.softmax(values, -1).cpu(), 1, generator=generator)
            nxt = int(indices[int(choice)])
        new.append(nxt)
        tokens.append(nxt)
        if nxt == stop_token:
            break
    return new


def load_tokenizer(cfg: Config, args, vocab_size: int):
    """The run's tokenizer (files found as saved or beside the checkpoint), with this tool's flags over it."""
    spec = run_tokenizer_spec(cfg.to_dict()["data"], vocab_size, near=[args.load], tokenizer_type=args.tokenizer_type,
                              tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                              merge_file=args.merge_file)
    if spec is None:
        raise ConfigError("--tokenizer-model: the run used no tokenizer (mock data?); pass --tokenizer-model "
                          "FILE.model (or --tokenizer-type with its files)")
    return spec.build()


def main(argv=None) -> int:
    p = OneLineParser(prog="generate.py", script="tools/generate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="merged checkpoint directory or a run's --save directory")
    p.add_argument("--prompt", required=True, help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 or 1: greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature for sampling")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json or transformers tokenizer "
                                             "directory (default: the run's)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: the run's")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json (default: the run's)")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt (default: the run's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    args = p.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
        if args.top_k < 0:
            raise ConfigError(f"--top-k {args.top_k}: must be 0 (greedy) or more")
        if args.temperature <= 0:
            raise ConfigError(f"--temperature {args.temperature}: must be positive; use --top-k 0 for greedy")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no GPU visible; use --device cpu")
        model, cfg, vocab_size = load_model(args.load, args.device)
        tok = load_tokenizer(cfg, args, vocab_size)
        if tok.vocab_size > vocab_size:
            raise ConfigError(f"{tok.source}: {tok.vocab_size} ids but the model has {vocab_size}; use the tokenizer "
                              "the model was trained with")
        try:
            prompt = tok.encode(args.prompt)
        except ValueError as e:  # a NullTokenizer's prompt that is not ids
            raise ConfigError(f"--prompt {args.prompt!r}: {e}") from None
        if not prompt and tok.eod is None:
            raise ConfigError(f"--prompt '': {tok.source} has no end-of-document token to start a new one with; "
                              "give a prompt")
    except ConfigError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    prompt = prompt or [tok.eod]
    max_length = cfg.model.seq_length
    if cfg.model.position_embedding_type == "learned_absolute":
        max_length = min(max_length, cfg.model.max_position_embeddings or max_length)
    gen = torch.Generator().manual_seed(args.seed)
    new = generate(model, prompt, args.max_new_tokens, vocab_size, max_length, args.top_k, args.temperature,
                   gen, stop_token=tok.eod)
    # Decode prompt and continuation together so the first new word keeps its leading space.
    head, full = tok.decode(prompt), tok.decode(prompt + new)
    print(full if full.startswith(head) else head + tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
