"""The compatibility matrix's per-request rows (docs/results/compat.md, tests/compat_matrix.py):
one server per policy column, started with the start-up features these rows need (a LoRA
adapter, `--max-num-seqs 1`, a 128-token step budget so prompts prefill in several chunks),
and per feature the served tokens against the plain-PyTorch reference doing the same thing:
- baseline: greedy decode; also the served policy is built once per process;
- structured outputs: the reference decodes under the same JSON-schema grammar (xgrammar, the
  library vLLM's backend uses, so the constraint is the same; attention is what is tested);
- prompt_logprobs / echo: every prompt position's log-prob, from the reference's chunked
  prefill (all positions' logits, the KV evicted at each chunk boundary);
- n > 1: vLLM refuses n > 1 with greedy sampling, so n = 2 with top_k = 1 (both children are
  greedy decodes of the same prompt, prefilled separately);
- beam search: vLLM runs it as one-token requests of prompt + beam; the reference runs the same
  algorithm on its own chunked prefills;
- LoRA: the reference model with the adapter merged into its weights;
- queued requests: three at once through `--max-num-seqs 1` (each runs alone, so its chunks
  are the regular ones);
- a repeated prompt: prefix caching serves it from cache under `full` and under a head mask
  (its streaming heads' sink + window in cached pool blocks); token eviction runs with prefix
  caching off and recomputes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest
import torch
from compat_matrix import COLUMNS as MATRIX_COLUMNS
from compat_matrix import SLOW_COLUMNS
from conftest import LORA_NAME, LORA_RANK, SERVED_NAME, served_policy_builds, start_server
from test_policies_vllm import CASES, LOGPROB_TOL, flags, reference, source_prompts

from vllm_kvevict.config import HEAD_MASK_POLICIES, KVPolicyConfig
from vllm_kvevict.masks import resolve_full_heads
from vllm_kvevict.policies import build_policy
from vllm_kvevict.reference import ReferenceRunner

pytestmark = pytest.mark.server

CHUNK = 128  # short prompts still prefill in several chunks
COLUMNS = {  # column -> policy: test_policies_vllm's cases, and full
    "full": {"policy": "full"},
    **{name: CASES[name][0] for name in ("streaming", "duo-0.3", "prulong-0.7",
                                         "snapkv-naive-0.5", "snapkv-patched-0.5",
                                         "pyramidkv-naive-0.5-tiers3", "pyramidkv-patched-0.7",
                                         "hybrid-prulong-0.5-snapkv-patched-0.5",
                                         "snapkv-naive-0.5-decode")},
}
SLOW = {MATRIX_COLUMNS[c] for c in SLOW_COLUMNS}  # their per-request rows: slow tier
NEW_TOKENS = 8
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in COLUMNS])
def column(request, bundled_model_dir, lora_adapter):
    """(column name, policy dict, server); pytest groups the tests by column: one start each."""
    policy = COLUMNS[request.param]
    _MEMO.clear()  # the previous column's reference results (logits of whole prompts)
    lora = [] if patched(policy) else [  # (refused with patched eviction: test_features.py)
        "--enable-lora", "--max-lora-rank", str(LORA_RANK),
        "--lora-modules", f"{LORA_NAME}={lora_adapter[0]}"]
    server = start_server(bundled_model_dir,
                          [*flags(policy, CHUNK), "--max-num-seqs", "1", *lora])
    return request.param, policy, server


def patched(policy: dict) -> bool:
    return KVPolicyConfig.from_dict(policy).patched


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference on one thread: beside a server's OpenMP pool on two cores, two pools slow
    each other down many times over (tests/test_speculative.py measured ~10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def runner(model, bundled_model_dir, policy: dict) -> ReferenceRunner:
    cfg = KVPolicyConfig.from_dict(policy)
    full_heads = None
    if cfg.policy in HEAD_MASK_POLICIES:
        full_heads, _ = resolve_full_heads(cfg, str(bundled_model_dir), 30, 3)
    return ReferenceRunner(model, build_policy(cfg, 30, 3, full_heads=full_heads))


_MEMO: dict = {}


def ref_generate(model, bundled_model_dir, policy: dict, ids, new_tokens=NEW_TOKENS):
    """The reference's greedy decode at the regular 128-token chunks, computed once per
    (model, policy, prompt): several rows ask for the same one."""
    key = ("generate", id(model), json.dumps(policy, sort_keys=True), tuple(ids), new_tokens)
    if key not in _MEMO:
        _MEMO[key] = reference(model, bundled_model_dir, policy, list(ids), CHUNK, new_tokens)
    return _MEMO[key]


def greedy(server, prompt, model=SERVED_NAME, **extra):
    r = client(server).completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                          temperature=0, extra_body=extra or None)
    return r.choices[0].text, r.model_extra.get("kv_stats")


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return source_prompts(tokenizer, (320,))[0]  # three chunks: evictions at 128 and 256


# -- rows ----------------------------------------------------------------------------------------
def test_baseline_matches_reference(column, bundled_model_dir, tokenizer, hf_model):
    name, policy, server = column
    for ids in source_prompts(tokenizer, (1000,)):
        r = client(server).completions.create(model=SERVED_NAME, prompt=ids, max_tokens=12,
                                              temperature=0, logprobs=1)
        ref = reference(hf_model, bundled_model_dir, policy, ids, CHUNK)
        assert r.choices[0].text == tokenizer.decode(ref.token_ids), (name, len(ids))
        first = r.choices[0].logprobs.token_logprobs[0]
        assert abs(first - float(ref.first_token_logprobs.max())) < LOGPROB_TOL
    # the served policy (and its mask file) is built once in each process: API server
    # (start-up validation), engine core (scheduler, stats connector) and worker (backend)
    builds = served_policy_builds(server)
    assert len(builds) == 3 and set(builds.values()) == {1}, builds


def test_structured_output_matches_constrained_reference(column, bundled_model_dir, tokenizer,
                                                         hf_model, prompt):
    import xgrammar as xgr

    name, policy, server = column
    ids = prompt[:280] + tokenizer("\nA JSON object with a name and an age: ")["input_ids"]
    r = client(server).completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    served_text = r.choices[0].text
    # the grammar is on (an object opens); within 40 tokens it may not close: under heavy
    # eviction the model can spend them on the whitespace the schema allows
    assert served_text.startswith("{"), served_text

    vocab = hf_model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=True))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ref = runner(hf_model, bundled_model_dir, policy)
    pre = ref.prefill(ids, CHUNK)
    logits, tokens = pre.logits[-1].clone(), []
    for i in range(40):
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits.view(1, -1), bitmask)
        token = int(torch.argmax(logits))
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
        tokens.append(token)
        logits = ref.decode_step(pre.cache, token, len(ids) + i).clone()
    assert served_text == tokenizer.decode(tokens), name


def reference_prompt_logprobs(hf_model, bundled_model_dir, policy, ids) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from the reference's chunked prefill."""
    logprobs = torch.log_softmax(ref_prefill_logits(hf_model, bundled_model_dir, policy, ids)[:-1],
                                 dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).view(-1, 1)).flatten().tolist()


def ref_prefill_logits(hf_model, bundled_model_dir, policy, ids) -> torch.Tensor:
    """Every prompt position's logits from the reference's chunked prefill (memoized)."""
    key = ("prefill", json.dumps(policy, sort_keys=True), tuple(ids))
    if key not in _MEMO:
        _MEMO[key] = runner(hf_model, bundled_model_dir, policy).prefill(
            list(ids), CHUNK, all_logits=True).logits
    return _MEMO[key]


def test_prompt_logprobs_match_reference(column, bundled_model_dir, hf_model, prompt):
    name, policy, server = column
    r = client(server).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    served = r.choices[0].model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(prompt)
    got = [entry[str(t)]["logprob"] for entry, t in zip(served[1:], prompt[1:])]
    want = reference_prompt_logprobs(hf_model, bundled_model_dir, policy, prompt)
    worst = max(range(len(want)), key=lambda i: abs(got[i] - want[i]))
    assert abs(got[worst] - want[worst]) < LOGPROB_TOL, (name, worst + 1, got[worst], want[worst])


def test_teacher_forced_tail_matches_reference_decode(column, bundled_model_dir, hf_model,
                                                     prompt):
    """`vllm_xargs: {"kv_teacher_forced": n}`: the prompt's last n tokens are served as decode
    tokens (what the evaluation's log-prob score uses): their prompt_logprobs equal the
    reference's prefill of the rest, then n forced decode steps."""
    name, policy, server = column
    forced = 10
    head, tail = prompt[:-forced], prompt[-forced:]
    r = client(server).completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 0, "vllm_xargs": {"kv_teacher_forced": forced}})
    served = r.choices[0].model_extra["prompt_logprobs"]
    got = [entry[str(t)]["logprob"] for entry, t in zip(served[-forced:], tail)]
    stats = r.model_extra["kv_stats"]
    assert (stats["prompt_tokens"], stats["teacher_forced_tokens"]) == (len(head), forced)
    assert stats["chunk_boundaries"] == [128, 256, len(head)] and stats["decode_steps"] == forced
    want = runner(hf_model, bundled_model_dir, policy).teacher_forced_logprobs(
        head, tail, stats["chunk_boundaries"])
    assert max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_TOL, (name, got, want)
    # Served as prompt, the same tokens get other log-probs: under a head mask they see their
    # chunk, under patched eviction they are part of the question. (Naive eviction here keeps
    # the whole 54-token final chunk, inside its 64-token observation window: the same.)
    if policy["policy"] in HEAD_MASK_POLICIES or patched(policy):
        plain = client(server).completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0,
            extra_body={"prompt_logprobs": 0}).choices[0].model_extra["prompt_logprobs"]
        as_prompt = [entry[str(t)]["logprob"] for entry, t in zip(plain[-forced:], tail)]
        assert max(abs(a - b) for a, b in zip(got, as_prompt)) > LOGPROB_TOL, name


def test_echo_with_logprobs_matches_reference(column, bundled_model_dir, tokenizer, hf_model,
                                              prompt):
    name, policy, server = column
    r = client(server).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                          temperature=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs.token_logprobs
    assert lp[0] is None and len(lp) == len(prompt) + NEW_TOKENS
    want = reference_prompt_logprobs(hf_model, bundled_model_dir, policy, prompt)
    assert max(abs(a - b) for a, b in zip(lp[1:len(prompt)], want)) < LOGPROB_TOL, name
    ref = ref_generate(hf_model, bundled_model_dir, policy, prompt)
    assert r.choices[0].text == tokenizer.decode(prompt) + tokenizer.decode(ref.token_ids)


def seeded_reference(model, bundled_model_dir, policy, ids, seed, temperature, new_tokens):
    """The reference's logits, sampled as vLLM's CPU sampler samples a seeded request: per
    step one 31-bit seed drawn from the request's generator (seeded with `seed`; no draw of a
    discarded partial-prefill step survives), then vLLM's Gumbel-max op on logits / T."""
    ref = runner(model, bundled_model_dir, policy)
    pre = ref.prefill(list(ids), CHUNK)
    generator = torch.Generator().manual_seed(seed)
    logits, tokens = pre.logits[-1], []
    for i in range(new_tokens):
        step_seed = torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        scaled = (logits.float() / temperature).view(1, -1)
        token = int(torch.ops._C.fused_gumbel_argmax(scaled, step_seed)[0])
        tokens.append(token)
        logits = ref.decode_step(pre.cache, token, len(ids) + i)
    return tokens


def test_seeded_sampling_over_several_prefill_steps_matches_reference(
        column, bundled_model_dir, tokenizer, hf_model, prompt):
    """`seed` with a prompt that prefills in three steps: stock vLLM 0.32's CPU worker died on
    it ("CPU Generator does not use offset"); here the tokens are the reference's sampled with
    the same seed, the same twice, and the server stays up (integration/worker/seeded_sampling.py)."""
    name, policy, server = column
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C, vLLM's sampling op)

    def sample(seed):
        r = client(server).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=12,
                                              temperature=0.8, seed=seed, logprobs=0)
        assert r.model_extra.get("kv_stats") is not None
        return r.choices[0].logprobs.tokens, r.choices[0].text

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again, name
    assert first != other, name  # 12 tokens at T = 0.8: the seed is really used
    want = seeded_reference(hf_model, bundled_model_dir, policy, prompt, 11, 0.8, 12)
    assert first[1] == tokenizer.decode(want), (name, first[1], tokenizer.decode(want))


def test_n_children_are_each_the_reference(column, bundled_model_dir, tokenizer, hf_model,
                                           prompt):
    name, policy, server = column
    r = client(server).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=NEW_TOKENS,
                                          n=2, temperature=1.0, extra_body={"top_k": 1})
    ref = tokenizer.decode(ref_generate(hf_model, bundled_model_dir, policy, prompt).token_ids)
    assert [c.text for c in r.choices] == [ref, ref], name
    assert r.model_extra.get("kv_stats") is not None


def reference_beam_search(hf_model, bundled_model_dir, policy, ids, width, steps):
    """vLLM's online beam search (entrypoints/generate/beam_search/online.py) over reference
    prefills: per beam the top 2 * width next tokens, the best `width` continuations by
    cumulative log-prob; without EOS every beam has one length, so the final order is by
    cumulative log-prob too."""
    beams = [(0.0, [])]
    for _ in range(steps):
        candidates = []
        for cum, toks in beams:
            logits = ref_prefill_logits(hf_model, bundled_model_dir, policy, ids + toks)[-1]
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * width)
            candidates += [(cum + float(v), toks + [int(t)])
                           for v, t in zip(top.values, top.indices)]
        beams = sorted(candidates, key=lambda c: -c[0])[:width]
    return [toks for _, toks in beams]


def test_beam_search_matches_reference_beam_search(column, bundled_model_dir, tokenizer,
                                                   hf_model, prompt):
    name, policy, server = column
    r = client(server).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2, n=2,
                                          temperature=0, extra_body={"use_beam_search": True})
    beams = reference_beam_search(hf_model, bundled_model_dir, policy, prompt, 2, 2)
    assert tokenizer.eos_token_id not in sum(beams, [])
    assert [c.text for c in r.choices] == [tokenizer.decode(b) for b in beams], name


def test_lora_adapter_matches_merged_reference(column, bundled_model_dir, tokenizer, hf_model,
                                               lora_model, prompt):
    name, policy, server = column
    if patched(policy):
        pytest.skip("LoRA with patched eviction is refused at start-up (test_features.py)")
    text, stats = greedy(server, prompt, model=LORA_NAME)
    ref = ref_generate(lora_model, bundled_model_dir, policy, prompt)
    assert text == tokenizer.decode(ref.token_ids), name
    base = ref_generate(hf_model, bundled_model_dir, policy, prompt)
    assert ref.token_ids != base.token_ids, "the adapter changes nothing: this checked nothing"
    assert stats is not None and stats["policy"] == policy["policy"]


def test_queued_requests_each_match_reference(column, bundled_model_dir, tokenizer, hf_model,
                                              prompt):
    name, policy, server = column
    prompts = [prompt[:200], prompt, prompt[:260]]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: greedy(server, p), prompts))
    for ids, (text, stats) in zip(prompts, results):
        if policy["policy"] != "full":  # (full: prefix-cache hits start later; no eviction)
            ends = list(range(CHUNK, len(ids), CHUNK)) + [len(ids)]
            assert stats["chunk_boundaries"] == ends, (name, stats["chunk_boundaries"])
        ref = ref_generate(hf_model, bundled_model_dir, policy, ids)
        assert text == tokenizer.decode(ref.token_ids), (name, len(ids))
    assert max(s["queue_s"] for _, s in results) > 0.0


def test_repeated_prompt_prefix_cache(column, bundled_model_dir, prompt):
    name, policy, server = column
    first, a = greedy(server, prompt)
    again, b = greedy(server, prompt)
    assert again == first
    serving = client(server).get("/kv_stats", cast_to=dict)["params"]
    caches = policy["policy"] == "full" or KVPolicyConfig.from_dict(policy).caches_prefixes
    assert serving["prefix_caching"] is caches, serving
    if caches:
        assert b["cached_tokens"] > 0, b
    else:
        assert b["cached_tokens"] == 0, b
