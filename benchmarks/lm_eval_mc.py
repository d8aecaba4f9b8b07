"""lm-evaluation-harness on a 4-choice multiple-choice task: `--model nanoinfer` against lm-eval's `hf` backend.

Method: a local task (dataset_path: json) of --num-questions questions written here from a seeded word list (about
60-150 tokens a question, 4 answers of about 5-30 tokens), so no hub access is needed and every run sees the same
data. Each backend runs in its own process, one after the other, on the same model and dtype: the model is loaded
(timed apart), then lm_eval.simple_evaluate runs the task (timed: the wall time of the evaluation). Printed: load
and evaluation seconds, requests per second, acc and acc_norm of each backend, the ratio of the evaluation times,
whether both chose the same answer for every question, the largest loglikelihood difference, and nanoinfer's
prompt tokens submitted and computed (what its prefix cache saved: the four answers share their question).

The hf backend runs with batch size 32 (--hf-batch-size): a usual setting for a model of this size; it pads each
batch to its longest request, so larger batches waste more, and `auto` only probes for out-of-memory errors, which
CPU runs do not raise (it would take max_batch_size, 64). nanoinfer batches by itself (max_num_seqs,
max_num_batched_tokens); lm-eval's batch_size does not apply to it.

Timings need a quiet machine (benchmarks/README.md); a single run says so. For a quick check that it works:

    python benchmarks/lm_eval_mc.py --num-questions 8
    python benchmarks/lm_eval_mc.py --num-threads 2 --output-json benchmarks/results/cpu-lm-eval-mc-f32.json
    python benchmarks/lm_eval_mc.py --num-threads 2 --dtype bfloat16 \
        --output-json benchmarks/results/cpu-lm-eval-mc-bf16.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = "nanoinfer_mc_bench"
WORDS = """
able absorb account acid across active actor adapt admit adult advance advice affect afford agency agent agree
airport alarm album alcohol alert alive alley almost alpha alter amazing amber amount analyst anchor ancient angle
animal ankle annual answer antenna anxiety apart apology appear apple approve april arch arctic arena argue armor
arrange arrest arrive arrow artist aspect assault asset assist assume asthma athlete atom attack attend attitude
auction audit august aunt author autumn average avocado avoid awake aware awkward axis baby bachelor bacon badge
balance balcony bamboo banana banner barely bargain barrel basket battle beach bean beauty become beef before begin
behave behind believe below bench benefit betray beyond bicycle bid biology bird birth bitter blade blanket blast
bleak blind blossom blouse blue blur blush board boat body boil bomb bone bonus book boost border boring borrow boss
bottom bounce bracket brain brand brass brave bread breeze brick bridge brief bright bring brisk broccoli bronze
brother brown brush bubble buddy budget buffalo build bulb bulk bullet bundle bunker burden burger burst butter
buyer buzz cabbage cabin cable cactus cage cake call calm camera camp canal cancel candy cannon canoe canvas canyon
capable capital captain carbon cargo carpet carry cart castle casual catalog catch category cattle caught cause
ceiling celery cement census century cereal certain chair chalk champion change chaos chapter charge chase cheap
check cheese chef cherry chest chicken chief child chimney choice chronic chuckle chunk cinnamon circle citizen city
civil claim clarify clay clean clerk clever click client cliff climb clinic clock close cloth cloud clown club
cluster coach coast coconut code coffee collect color column combine comfort comic common company concert conduct
confirm congress connect consider control convince cook copper coral core corn correct cost cotton couch country
couple course cousin cover coyote crack cradle craft crane crash crater crawl crazy cream credit creek crew cricket
crime crisp critic crop cross crouch crowd crucial cruel cruise crumble crunch crush crystal cube culture cupboard
curious current curtain curve cushion custom cycle damage damp dance danger daring dash daughter dawn debate debris
decade december decide decline decorate decrease deer defense define degree delay deliver demand denial dentist
deposit depth deputy derive describe desert design desk despair destroy detail detect develop device devote diagram
dial diamond diary diesel diet differ digital dignity dilemma dinner dinosaur direct dirt disagree discover disease
dish dismiss disorder display distance divert divide divorce doctor document dolphin domain donate donkey donor door
dose double dove draft dragon drama drastic dream dress drift drill drink drip drive drop drum dune during dust
dutch duty dwarf dynamic eager eagle early earn earth easily east echo ecology economy edge edit educate effort
""".split()


def sentence(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    for i in range(7, num_words - 1, rng.randint(7, 14)):  # commas and full stops every dozen words or so
        words[i] += rng.choice([",", ",", "."])
    text = " ".join(words)
    return text[0].upper() + text[1:]


def write_task(folder: Path, num_questions: int, seed: int = 0) -> None:
    """mc.jsonl (question, 4 choices, answer index) and the task's YAML, in `folder` (an include_path)."""
    rng = random.Random(seed)
    with open(folder / "mc.jsonl", "w") as f:
        for _ in range(num_questions):
            question = sentence(rng, rng.randint(45, 110)) + "?"
            choices = [sentence(rng, rng.randint(4, 22)) + "." for _ in range(4)]
            f.write(json.dumps({"question": question, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: choices\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n"
    )


def run_backend(args: argparse.Namespace) -> dict:
    """In the worker process: load the backend's LM, then evaluate the task; timings, metrics and loglikelihoods."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model_dir = Path(args.model)
    start = time.perf_counter()
    if args.worker == "hf":
        from lm_eval.models.huggingface import HFLM

        kwargs = {}
        ggufs = sorted(model_dir.glob("*.gguf")) if not any(model_dir.glob("*.safetensors")) else []
        if ggufs:  # transformers dequantizes the GGUF; the folder's tokenizer.json is nanoinfer's tokenizer too
            kwargs = {"gguf_file": ggufs[0].name, "tokenizer": str(model_dir)}
        lm = HFLM(pretrained=str(model_dir), dtype=args.dtype, batch_size=args.hf_batch_size, device=device, **kwargs)
    else:
        from nanoinfer.lm_eval import NanoInferLM

        lm = NanoInferLM(pretrained=str(model_dir), dtype=args.dtype, num_threads=args.num_threads,
                         cpu_kernels="wait")  # fmt: skip  (bench's choice: time the compiled kernels, not plain torch)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=args.task_dir),
                                      log_samples=True)  # fmt: skip
    eval_s = time.perf_counter() - start
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    metrics = results["results"][TASK]
    return {
        "backend": args.worker, "device": device, "load_s": load_s, "eval_s": eval_s,
        "num_requests": sum(len(s["resps"]) for s in samples),
        "acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"],
        "loglikelihoods": [[float(resp[0][0]) for resp in s["resps"]] for s in samples],
        "token_counts": getattr(lm, "last_token_counts", None),
    }  # fmt: skip


def run_in_own_process(backend: str, args: argparse.Namespace, task_dir: Path) -> dict:
    command = [sys.executable, __file__, "--worker", backend, "--task-dir", str(task_dir), "--model", args.model,
               "--dtype", args.dtype, "--hf-batch-size", str(args.hf_batch_size),
               "--num-threads", str(args.num_threads)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the {backend} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-questions", type=int, default=500)
    parser.add_argument("--hf-batch-size", type=int, default=32, help="the hf backend's batch size (see above)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=None, help="a model folder (default: the built-in default model)")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads of both (0: their defaults)")
    parser.add_argument("--output-json", default=None, help="write the result here (e.g. under benchmarks/results/)")
    parser.add_argument("--worker", choices=["hf", "nanoinfer"], help=argparse.SUPPRESS)
    parser.add_argument("--task-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_backend(args)))
        return
    if args.model is None:
        from nanoinfer.config import DEFAULT_MODEL
        from nanoinfer.model_source import resolve_model

        args.model = str(resolve_model(DEFAULT_MODEL))

    with tempfile.TemporaryDirectory(prefix="lm-eval-mc-") as tmp:
        task_dir = Path(tmp)
        write_task(task_dir, args.num_questions)
        args.token_lengths = token_lengths(args.model, task_dir / "mc.jsonl")
        runs = {backend: run_in_own_process(backend, args, task_dir) for backend in ("hf", "nanoinfer")}
    report(args, runs)


def token_lengths(model: str, data: Path) -> dict:
    """Mean and range of the questions' and answers' lengths in the model's tokens."""
    from nanoinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    lengths = {"question": [len(tokenizer.encode(f"Question: {d['question']}\nAnswer:")) for d in docs],
               "answer": [len(tokenizer.encode(" " + c, add_special_tokens=False)) for d in docs for c in d["choices"]]}
    return {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for k, v in lengths.items()}


def report(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    hf, ours = runs["hf"], runs["nanoinfer"]
    choices = [[max(range(len(lls)), key=lls.__getitem__) for lls in run["loglikelihoods"]] for run in (hf, ours)]
    num_different = sum(a != b for a, b in zip(*choices))
    max_difference = max(abs(a - b) for x, y in zip(hf["loglikelihoods"], ours["loglikelihoods"])
                         for a, b in zip(x, y))  # fmt: skip
    print(f"{args.num_questions} questions x 4 choices, {args.dtype}, {hf['device']}, model {args.model}")
    print("tokens: " + ", ".join(f"{k} {v['mean']:.0f} on average ({v['min']}-{v['max']})"
                                 for k, v in args.token_lengths.items()))  # fmt: skip
    print(f"{'backend':10s} {'load s':>7s} {'eval s':>8s} {'req/s':>7s} {'acc':>7s} {'acc_norm':>8s}")
    for run in (hf, ours):
        requests_per_s = run["num_requests"] / run["eval_s"]
        print(f"{run['backend']:10s} {run['load_s']:7.1f} {run['eval_s']:8.1f} {requests_per_s:7.1f}"
              f" {run['acc']:7.4f} {run['acc_norm']:8.4f}")  # fmt: skip
    ratio = hf["eval_s"] / ours["eval_s"]
    print(f"evaluation time hf / nanoinfer: {ratio:.2f}x")
    same = hf["acc"] == ours["acc"] and hf["acc_norm"] == ours["acc_norm"]
    print(f"same acc and acc_norm: {'yes' if same else 'NO'}; questions answered differently: {num_different}; "
          f"largest loglikelihood difference: {max_difference:.2e}")
    counts = ours["token_counts"]
    if counts:
        print(f"nanoinfer prompt tokens: {counts['submitted']:,} submitted, {counts['computed']:,} computed "
              f"({1 - counts['computed'] / counts['submitted']:.1%} from the prefix cache)")
    if args.output_json:
        from nanoinfer.bench import machine_info

        result = {
            "benchmark": "lm_eval_mc", "num_questions": args.num_questions, "dtype": args.dtype,
            "model": args.model, "hf_batch_size": args.hf_batch_size, "num_threads": args.num_threads,
            "token_lengths": args.token_lengths,
            "runs": {name: {k: v for k, v in run.items() if k != "loglikelihoods"} for name, run in runs.items()},
            "hf_over_nanoinfer": ratio, "same_acc": same, "num_different_answers": num_different,
            "max_loglikelihood_difference": max_difference, "machine": machine_info(hf["device"]),
        }  # fmt: skip
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
