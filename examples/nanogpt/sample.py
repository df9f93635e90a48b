"""Generate text with the model of the latest checkpoint that train.py wrote.

Run:  python examples/nanogpt/sample.py --out-dir runs/nanogpt --start "The with statement"

One process, no launcher. The vocabulary and the model's shape come from --out-dir/meta.json, the
weights from the newest checkpoint in --out-dir/checkpoints that verifies (distkit checks every
file's checksum before loading it), or from --checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from data import CharTokenizer
from model import GPT, GPTConfig

import distkit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=Path("runs/nanogpt"), help="train.py's --out-dir")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the latest)")
    parser.add_argument("--start", default="\n", help="the prompt")
    parser.add_argument("--num-samples", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="< 1 sharper, > 1 more random")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest characters")
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()

    meta = json.loads((args.out_dir / "meta.json").read_text())
    tokenizer = CharTokenizer(meta["vocab"])
    model = GPT(GPTConfig(**meta["model"]))
    path = args.checkpoint or distkit.CheckpointManager(args.out_dir / "checkpoints").latest()
    if path is None:
        raise SystemExit(f"no checkpoint in {args.out_dir / 'checkpoints'}; run train.py first.")
    distkit.load_checkpoint(path, {"model": model}, map_location="cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()

    torch.manual_seed(args.seed)
    prompt = torch.tensor([tokenizer.encode(args.start)], dtype=torch.long, device=device)
    print(f"# {path}")
    for _ in range(args.num_samples):
        out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
        print(tokenizer.decode(out[0].tolist()))
        print("-" * 60)


if __name__ == "__main__":
    main()
