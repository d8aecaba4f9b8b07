"""What a grammar costs a batch: the same chat prompts on the built-in default model, free and held to a JSON
schema (xgrammar's mask on every token), alternated in one process; prints output tok/s and ms a token.

    python benchmarks/tools/structured_output_cost.py [--requests 32] [--max-tokens 64] [--rounds 3]

The schema asks for what the prompts ask for, so both runs generate similar lengths; the report counts the
tokens each produced. Greedy, float32 (the engine's defaults on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nanoinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
}
CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(device="cpu", max_model_len=1024)
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as JSON "
                                         "with city, country, population_millions and landmarks."}])
               for i in range(args.requests)]
    runs = {"free": SamplingParams(temperature=0, max_tokens=args.max_tokens),
            "json_schema": SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                          structured_outputs={"json": SCHEMA})}
    llm.generate(prompts[:2], list(runs.values()))  # warm-up, and the schema's compile
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, params in runs.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            results[name].append((seconds, sum(len(o.token_ids) for o in outs)))
    report = {}
    for name, rounds in results.items():
        rates = [tokens / seconds for seconds, tokens in rounds]
        report[name] = {"tok_s_median": statistics.median(rates), "tok_s": rates,
                        "tokens": [t for _, t in rounds], "ms_per_token": 1000 / statistics.median(rates)}
    report["ratio_json_to_free"] = report["json_schema"]["tok_s_median"] / report["free"]["tok_s_median"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
