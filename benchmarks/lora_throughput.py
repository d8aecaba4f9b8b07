"""Multi-LoRA throughput: the default `nanoinfer bench` workload with its requests spread evenly over N rank-16
adapters, against the same engine without adapters, in one process (`nanoinfer bench --lora ... --compare base`).

Method: random PEFT adapters of rank 16 on all seven projections (q, k, v, o, gate, up, down: the most work an
adapter adds) are built for the model with PEFT itself (~/.cache/nanoinfer/bench-adapters, reused), then `nanoinfer
bench` runs the default CPU workload (64 requests, 32..256 tokens in and out, greedy, seed 0) once with request i on
adapter i mod N, and once on the base model with the same settings and no adapters, one after the other in the same
process. The ratio is adapters' output tok/s over the base model's. Each N writes its bench JSON to
benchmarks/results/lora/.

    python benchmarks/lora_throughput.py                     # N = 4 and N = 1, the default model, float32
    python benchmarks/lora_throughput.py --adapters 4 --num-requests 16   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RESULTS = Path(__file__).parent / "results" / "lora"
ADAPTERS = Path.home() / ".cache" / "nanoinfer" / "bench-adapters"  # ~20 MB each: not in the repository


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--adapters", type=int, nargs="+", default=[4, 1], help="adapter counts to run")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=None, help="default: bench's (64 on CPU)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from nanoinfer.model_source import resolve_model
    from nanoinfer.testing.tiny_lora import build_tiny_adapter

    model = resolve_model(args.model)
    folders = []
    for i in range(max(args.adapters)):
        folder = ADAPTERS / f"{Path(model).name}-r{args.rank}-{i}"
        if not (folder / "adapter_model.safetensors").is_file():  # std 0.02: deltas of a fine-tune's size
            build_tiny_adapter(model, folder, rank=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                               std=0.02, seed=i)  # fmt: skip
        folders.append(folder)
    for n in args.adapters:
        output = args.out / f"cpu-lora-{n}x-r{args.rank}-{args.dtype}.json"
        command = ["nanoinfer", "bench", "--model", str(model), "--dtype", args.dtype,
                   "--compare", "base", "--max-lora-rank", str(args.rank), "--output-json", str(output)]  # fmt: skip
        for i, folder in enumerate(folders[:n]):
            command += ["--lora", f"adapter{i}={folder}"]
        if args.num_requests:
            command += ["--num-requests", str(args.num_requests)]
        subprocess.run(command, check=True)
        report = json.loads(output.read_text())
        print(f"{n} adapter(s): {report['ratio']['output_tok_s']:.3f}x the base model's output tok/s")


if __name__ == "__main__":
    main()
