"""Runs vLLM (inside the vLLM virtual environment) for tests/test_vllm.py and prints what it served.

    python vllm_driver.py '<json list of runs>'

Each run: {"model": DIR, "dtype": "bfloat16", "tp": 1, "load_format": "auto" | "weightcache",
"extra": {...} (--model-loader-extra-config), "prompts": [[token ids], ...], "max_tokens": 8}.
One line per run on stdout: `RESULT {"tokens": [[...], ...], "text": [...]}` or
`RESULT {"error": "..."}`, and before each run a line `RUN i` on stdout and on stderr, which
marks where the run's log starts. The runs share this process (vLLM's in-process engine where
VLLM_ENABLE_V1_MULTIPROCESSING=0, torn down between runs); tp > 1 starts a worker process per rank.
"""
import gc
import json
import os
import sys


def run_one(run: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {}
    if run.get("load_format", "auto") != "auto":
        kwargs = dict(load_format=run["load_format"], model_loader_extra_config=run.get("extra") or {})
    try:
        llm = LLM(model=run["model"], dtype=run.get("dtype", "bfloat16"), tensor_parallel_size=run.get("tp", 1),
                  max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=32 << 20, seed=0,
                  distributed_executor_backend="mp" if run.get("tp", 1) > 1 else None, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the test asserts on the message
        return {"error": f"{type(e).__name__}: {e}"}
    params = SamplingParams(max_tokens=run.get("max_tokens", 8), temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in run["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "text": [o.outputs[0].text for o in outs]}
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    del llm, outs
    gc.collect()
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    return result


def main() -> None:
    for i, run in enumerate(json.loads(sys.argv[1])):
        print(f"RUN {i}", flush=True)
        print(f"RUN {i}", file=sys.stderr, flush=True)
        print("RESULT " + json.dumps(run_one(run)), flush=True)


if __name__ == "__main__":
    main()
