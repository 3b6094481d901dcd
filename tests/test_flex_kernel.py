"""The portable attention path at kernel level (torch only, no server): flex_attention with the
block masks of `vllm_kvevict/flex/block_mask.py` against the reference's attention, per
head-mask policy and for token eviction's step, and the block sparsity of a streaming head
against prompt length."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.flex import kernel_check
from vllm_kvevict.flex.block_mask import chunk_starts


def test_chunk_starts_per_token():
    # a prefill step resuming at 512, a decode, a recomputed request past its prompt (300)
    starts = chunk_starts([512, 900, 0], [3, 1, 302], [700, 600, 300])
    assert starts[:3].tolist() == [512] * 3
    assert starts[3].item() == 900
    assert starts[4:304].eq(0).all() and starts[304:].tolist() == [300, 301]
    # canonical chunks of 128: a step [100, 300) holds pieces of three chunks
    assert chunk_starts([100], [200], [700], chunk=128).unique().tolist() == [0, 128, 256]


def test_flex_matches_reference_per_policy():
    diffs = kernel_check.check_policies("cpu")
    assert set(diffs) == {"full", "streaming", "duo-0.3", "prulong-0.7"}
    for name, diff in diffs.items():
        assert diff < 1e-4, (name, diff)


def test_token_eviction_step_matches_reference():
    """Compacted rows by physical position and a patched question row sharing its request's
    pages (compiled flex_attention, as served); a reference whose question does not see the
    chunk differs (the check can tell)."""
    assert kernel_check.check_token_eviction("cpu") < 1e-4
    assert kernel_check.check_token_eviction("cpu", eager=True, question_sees_chunk=False) > 1e-2


def test_wrong_mask_is_caught():
    """Negative control: streaming heads checked against a full-attention reference differ."""
    heads = torch.ones(kernel_check.NUM_KV_HEADS, dtype=torch.bool)
    diff = kernel_check.run_case(heads, kernel_check.MIXED_ROWS, 16, 64, None, "cpu", False,
                                 reference_streaming=~heads)
    assert diff > 1e-2


@pytest.mark.parametrize("chunk", [256])
def test_streaming_blocks_do_not_grow_with_prompt(chunk):
    rows = kernel_check.block_counts((2048, 4096, 8192), chunk=chunk, sink=64, window=256)
    streaming = {r["prefill_streaming"] for r in rows}
    decode = {r["decode_streaming"] for r in rows}
    assert len(streaming) == 1 and len(decode) == 1  # flat in the prompt length
    q_blocks, pages = chunk // 16, (64 + 256 + chunk) // 16 + 1
    assert streaming.pop() <= q_blocks * pages        # sink + window + chunk, at most
    assert decode.pop() <= (64 + 256) // 16 + 1
    full = [r["prefill_full"] for r in rows]
    assert full[0] < full[1] < full[2] and full[2] > 15 * rows[2]["prefill_streaming"]


def test_whole_pages_are_a_subset_and_exact():
    """The full-block lists (optional) hold pages every query of the block sees whole; the
    union of both lists is the same set of pages as without them."""
    from vllm_kvevict.flex.block_mask import head_mask_block_mask, paged_queries

    table, num_pages = kernel_check.scattered_block_table([4096], torch.Generator().manual_seed(1))
    batch = paged_queries([4096 - 256], [256], table, 16, num_pages, [4096])
    streaming = torch.tensor([False, True])
    plain = head_mask_block_mask(batch, streaming, 64, 256)
    whole = head_mask_block_mask(batch, streaming, 64, 256, whole_pages=True)
    assert int(whole.full_kv_num_blocks.sum()) > 0
    assert torch.equal(plain.kv_num_blocks, whole.kv_num_blocks + whole.full_kv_num_blocks)
