"""The self-check's served side, in vLLM's offline `LLM` class (run as one subprocess by the
self-check, so the checking process never holds an engine):

    python -m vllm_kvevict.selfcheck.serve_cell '<json list of cells>'

Each cell builds its own `LLM` (its own engine-core process, so its own plugin state), sends
its prompts one at a time and prints one `RESULT <json>` line per prompt: the greedy tokens,
the first token's log-prob and the chunk boundaries the engine reports in kv_stats. A cell that
fails prints `CELLERROR <json>` and the next cell runs."""

from __future__ import annotations

import gc
import json
import sys


def serve(cell: dict) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=cell["model"], additional_config={"kv_policy": cell["policy"]},
              enforce_eager=True, dtype=cell["dtype"], max_model_len=cell["max_model_len"],
              kv_cache_memory_bytes=cell["kv_cache_bytes"], seed=0,
              max_num_batched_tokens=cell["chunk"], skip_tokenizer_init=True,
              enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=cell["new_tokens"], logprobs=1,
                                ignore_eos=True, detokenize=False)
        for i, prompt in enumerate(cell["prompts"]):  # one at a time: chunks every `chunk`
            [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            completion = out.outputs[0]
            first = completion.token_ids[0]
            stats = (out.kv_transfer_params or {}).get("kv_stats") or {}
            print("RESULT " + json.dumps({
                "cell": cell["name"], "prompt": i, "token_ids": list(completion.token_ids),
                "first_logprob": completion.logprobs[0][first].logprob,
                "chunk_boundaries": stats.get("chunk_boundaries")}), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(cells: list[dict]) -> None:
    for cell in cells:
        try:
            serve(cell)
        except Exception as exc:  # the cell's row says why; the next cell runs
            print("CELLERROR " + json.dumps({"cell": cell["name"],
                                             "error": f"{type(exc).__name__}: {exc}"[:500]}),
                  flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
