"""Embedding throughput: nanoinfer's pooling runner (LLM.embed, in process) against SentenceTransformer.encode.

Method: one process, the same model folder on both sides: by default the built-in default model (SmolLM2-135M-
Instruct, its GGUF, which transformers dequantizes through its own GGUF loader) inside a temporary
sentence-transformers folder (links to its files + mean pooling + Normalize, the classic hub layout, so
sentence-transformers embeds the plain text). --num-texts texts of 4..300 words (seeded, so every run embeds the
same texts) are embedded by each side after a warm-up of 8 texts; the wall time of the call is measured (model
loading excluded), the two sides alternated for --rounds rounds and the median kept. sentence-transformers runs
with encode()'s default batch_size 32 (what a user gets; it sorts texts by length first, so padding stays small);
nanoinfer with its defaults (continuous batching up to max_num_batched_tokens). Both use the same dtype and
torch's thread count as nanoinfer sets it. The agreement is the smallest cosine between the two sides' vectors.
On the default model nanoinfer's CPU linear method reads the GGUF's Q4_1 blocks in its float32 GEMM: the same
weight values as transformers' dequantized float32 copy (so the vectors agree), from a seventh of the bytes. Pass
--model a safetensors folder to have float32 weights on both sides.

    python benchmarks/embed_throughput.py                           # 2,000 texts, float32
    python benchmarks/embed_throughput.py --dtype bfloat16 --save   # also writes benchmarks/results/...json
    python benchmarks/embed_throughput.py --num-texts 16 --rounds 1 # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an not have which but they all one "
    "model cache token batch prefill decode attention layer weight kernel memory request sequence block vector "
    "Paris Berlin Rome river mountain city history science music language number market energy water system "
    "quickly slowly because although however therefore while during after before between under over through"
).split()
MAX_WORDS = 300  # about 400 tokens: under the 1,024-token limit both sides get, so neither truncates


def make_texts(num_texts: int, seed: int = 0) -> list[str]:
    """Texts of 4..MAX_WORDS words, log-uniform (many short, some long), with sentence punctuation."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        num_words = int(math.exp(rng.uniform(math.log(4), math.log(MAX_WORDS))))
        words = [rng.choice(WORDS) for _ in range(num_words)]
        texts.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
    return texts


def st_model(folder: Path, dtype: str):
    import torch
    from sentence_transformers import SentenceTransformer

    ggufs = sorted(folder.glob("*.gguf")) if not any(folder.glob("*.safetensors")) else []
    model_kwargs = {"dtype": getattr(torch, dtype)} | ({"gguf_file": ggufs[0].name} if ggufs else {})
    return SentenceTransformer(str(folder), device="cpu", model_kwargs=model_kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32, help="SentenceTransformer.encode's (its default)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: one per physical core)")
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/<device>-embed-throughput-<dtype>.json")
    args = parser.parse_args()

    import torch

    from nanoinfer import LLM
    from nanoinfer.bench import machine_info
    from nanoinfer.config import DEFAULT_MODEL
    from nanoinfer.model_source import resolve_model
    from nanoinfer.testing.st_folders import make_st_folder

    model_dir = resolve_model(args.model or DEFAULT_MODEL)
    texts = make_texts(args.num_texts)
    with tempfile.TemporaryDirectory(prefix="nanoinfer-embed-bench-") as tmp:
        folder = make_st_folder(model_dir, Path(tmp) / "st", "mean", normalize=True, max_seq_length=1024)
        llm = LLM(str(folder), runner="pooling", dtype=args.dtype, device="cpu", max_model_len=1025,
                  num_threads=args.num_threads)  # fmt: skip
        st = st_model(folder, args.dtype)
        num_tokens = [len(llm.encode(text)) for text in texts]
        if max(num_tokens) >= 1024:
            sys.exit(f"a text has {max(num_tokens)} tokens: sentence-transformers would truncate it; lower MAX_WORDS")
        llm.embed(texts[:8])  # warm-up
        st.encode(texts[:8], batch_size=args.batch_size)
        times: dict[str, list[float]] = {"nanoinfer": [], "sentence-transformers": []}
        for _ in range(args.rounds):
            start = time.perf_counter()
            ours = np.array([o.outputs.embedding for o in llm.embed(texts)])
            times["nanoinfer"].append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs = st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
            times["sentence-transformers"].append(time.perf_counter() - start)
        config = llm.config
        device = "cpu"
    cosines = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    total_tokens = sum(num_tokens)
    print(f"{args.num_texts} texts, {total_tokens:,} tokens ({min(num_tokens)}..{max(num_tokens)} a text), mean "
          f"pooling + normalize, {args.dtype}, {torch.get_num_threads()} torch threads, {model_dir.name}")
    for name, value in seconds.items():
        rounds = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"  {name:22s} {value:8.2f} s  {args.num_texts / value:8.1f} texts/s  {total_tokens / value:9.0f} "
              f"tok/s  (rounds: {rounds})")
    ratio = seconds["sentence-transformers"] / seconds["nanoinfer"]
    print(f"  nanoinfer is {ratio:.2f}x sentence-transformers' speed (batch_size {args.batch_size})")
    print(f"  max cosine gap: {1 - cosines.min():.2e} (min cosine {cosines.min():.6f})")
    if args.save:
        result = {
            "schema": "nanoinfer-embed-throughput/1",
            "command": " ".join(["python", *sys.argv]),
            "machine": machine_info(device),
            "model": str(model_dir),
            "workload": {"num_texts": args.num_texts, "num_tokens": total_tokens, "min_tokens": min(num_tokens),
                         "max_tokens": max(num_tokens), "seed": 0, "pooling": "mean", "normalize": True},
            "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
            "st_batch_size": args.batch_size,
            "seconds": times,
            "texts_per_s": {name: args.num_texts / value for name, value in seconds.items()},
            "speedup": ratio,
            "min_cosine": float(cosines.min()),
        }
        path = Path(__file__).parent / "results" / f"{device}-embed-throughput-{args.dtype}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
