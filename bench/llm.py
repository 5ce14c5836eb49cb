"""LLM decode throughput and per-token latency for R concurrent streams, three ways in one run:
the engine with its micro-ops on the runtime, the same engine launching each micro-op with torch,
and per-request eager decode (each request its own forward with its own KV cache, one after the
other every round). Greedy, fixed prompt and completion lengths, so every way does the same work.
Writes llm.json to --out and prints the ratios.

    python3 bench/llm.py --out bench/results [--backend cuda] [--family gpt2] [--streams 1 8 32 64]

The model is random, of GPT-2 small's shape by default (12 layers, hidden 768, 12 heads; vocab 256
so the byte tokenizer decodes every id), saved and loaded through the Hugging Face path in fp16
(fp32 on the CPU backend).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpuos_core import Runtime
from micro import describe, p99  # bench/ is the script's directory
from serving.llm import ByteTokenizer, Model, forward_tokens, load_model
from serving.llm.engine import Engine, EngineConfig
from serving.llm.model import TINY, parse_config, random_weights, save_pretrained, weights_to_hf
from serving.llm.sampling import SamplingParams

faulthandler.dump_traceback_later(560, exit=True)
SHAPES = {  # config.json overrides of the tiny configs: GPT-2 small, and a Llama of similar size
    "gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
    "llama": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "intermediate_size": 2048, "max_position_embeddings": 1024},
}


def make_model(family: str, device: str, dtype: torch.dtype, where: Path) -> Model:
    raw = {**TINY[family], **SHAPES[family]}
    config = parse_config(raw)
    save_pretrained(where, raw, weights_to_hf(config, random_weights(config, seed=0)))
    return load_model(where, dtype=dtype, device=device)


def prompts(r: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(r)
    return [torch.randint(1, 256, (length,), generator=gen).tolist() for _ in range(r)]


def engine_run(engine: Engine, batch: list[list[int]], new: int) -> dict:
    """All prompts submitted at once; wall time to the last token, and inter-token gaps."""
    params = SamplingParams(max_tokens=new, temperature=0.0)
    started = time.perf_counter()
    streams = [engine.submit(p, params) for p in batch]
    for s in streams:
        assert list(s)[-1].finish_reason == "length"
    wall = time.perf_counter() - started
    gaps = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
    first = [s.token_times[0] - started for s in streams]
    return row(len(batch), new, wall, gaps, first)


def eager_run(model: Model, batch: list[list[int]], new: int, device: str) -> dict:
    """Each request its own forward every round (prefill first, then one token per round)."""
    caches = [model.new_cache(len(batch[0]) + new) for _ in batch]
    started = time.perf_counter()
    last = [int(forward_tokens(model, torch.tensor(p, device=device), c).argmax(-1)[-1])
            for p, c in zip(batch, caches)]
    rounds = [time.perf_counter()]
    for step in range(new - 1):
        start = len(batch[0]) + step
        last = [int(forward_tokens(model, torch.tensor([t], device=device), c, start)[-1].argmax())
                for t, c in zip(last, caches)]
        rounds.append(time.perf_counter())
    gaps = [b - a for a, b in zip(rounds, rounds[1:])] * len(batch)
    return row(len(batch), new, rounds[-1] - started, gaps, [rounds[0] - started] * len(batch))


def row(r: int, new: int, wall: float, gaps: list[float], first: list[float]) -> dict:
    return {"streams": r, "tokens": r * new, "wall_s": wall, "tokens_per_s": r * new / wall,
            "token_p50_ms": 1e3 * statistics.median(gaps), "token_p99_ms": 1e3 * p99(gaps),
            "first_token_p50_ms": 1e3 * statistics.median(first)}


def measure(model: Model, runtime: Runtime, streams: list[int], prompt: int, new: int,
            device: str) -> list[dict]:
    rows = []
    for micro_ops in ("runtime", "torch"):
        engine = Engine(model, ByteTokenizer(eos_id=None), runtime,
                        EngineConfig(max_running=max(streams), max_len=prompt + new + 1,
                                     micro_ops=micro_ops))
        try:
            engine_run(engine, prompts(2, prompt), 4)  # warm-up
            for r in streams:
                rows.append({"way": f"engine+{micro_ops}", **engine_run(engine, prompts(r, prompt),
                                                                          new)})
                print(rows[-1], flush=True)
        finally:
            engine.close()
    eager_run(model, prompts(2, prompt), 4, device)
    for r in streams:
        rows.append({"way": "eager per request", **eager_run(model, prompts(r, prompt), new, device)})
        print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per R: tokens/s of each way and the runtime engine's ratios over the others."""
    out = {}
    for r in sorted({x["streams"] for x in rows}):
        by = {x["way"]: x for x in rows if x["streams"] == r}
        ours = by["engine+runtime"]["tokens_per_s"]
        out[f"R{r}"] = {"runtime_tok_s": ours,
                        "torch_ops_tok_s": by["engine+torch"]["tokens_per_s"],
                        "eager_tok_s": by["eager per request"]["tokens_per_s"],
                        "runtime_over_torch_ops": ours / by["engine+torch"]["tokens_per_s"],
                        "runtime_over_eager": ours / by["eager per request"]["tokens_per_s"],
                        "runtime_token_p50_ms": by["engine+runtime"]["token_p50_ms"],
                        "runtime_token_p99_ms": by["engine+runtime"]["token_p99_ms"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--family", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per stream")
    args = parser.parse_args()
    with Runtime(args.backend) as rt, tempfile.TemporaryDirectory() as tmp:
        device = str(rt.device)
        dtype = torch.float16 if args.backend == "cuda" else torch.float32
        model = make_model(args.family, device, dtype, Path(tmp))
        result = describe() if args.backend == "cuda" else {"device": "cpu"}
        result.update(family=args.family, dtype=str(dtype), prompt=args.prompt, new=args.new)
        with torch.inference_mode():
            result["rows"] = measure(model, rt, args.streams, args.prompt, args.new, device)
    result["summary"] = summary(result["rows"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"llm-{args.family}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
