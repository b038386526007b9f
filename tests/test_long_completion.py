"""A 4,096-token completion through a paged KV cache sized from a memory budget, served over
HTTP by this project's generator server (in process, a tiny random model): the completion's
log-probs are the trainer's, a request that could never fit the budget gets a 400 naming it
(not an out-of-memory crash), and the systems model's KV cache is the engine's page pool,
byte for byte."""

import asyncio
import time

import jax.numpy as jnp
import numpy as np
import pytest

from generator_fixtures import ALPHABET, EOS, write_random_checkpoint
from rl_jax.data.tokenizer import build_char_tokenizer
from rl_jax.generator.engine.runner import ModelRunner
from rl_jax.models.config import ModelConfig

PAGE = 64
PAGES = 80  # 5,120 tokens: one 4,106-token sequence (65 pages) at a time, not two
COMPLETION = 4096
PROMPT = 10
MAX_SEQ_LEN = 8192


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig
    tok = build_char_tokenizer(ALPHABET)
    # A shape the native decode attention takes (it reads each slot's own length: one decode
    # program for every length, where XLA's attention compiles one per length bucket).
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, bos_token_id=1,
                      eos_token_id=EOS, pad_token_id=0)
    path = write_random_checkpoint(cfg, tmp_path_factory.mktemp("ckpt") / "m", tok, seed=0)
    budget = PAGES * ModelRunner.page_bytes(cfg, PAGE, jnp.float32) + 1000  # not whole pages
    server = GeneratorServer.from_config(ServerConfig(
        model=str(path), max_slots=2, max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
        kv_cache_bytes=budget, dtype="float32", decode_steps=1, attention_backend="native",
        warmup=False))
    yield server, cfg, budget, path
    server.engine.shutdown()


def test_a_4096_token_completion_through_the_budgeted_page_pool(served):
    from aiohttp.test_utils import TestClient, TestServer
    server, cfg, budget, path = served
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, PROMPT).tolist()

    async def main():
        async with TestClient(TestServer(server.app())) as client:
            info = await (await client.get("/get_server_info")).json()
            assert info["max_total_num_tokens"] == PAGES * PAGE and info["page_size"] == PAGE
            start = time.perf_counter()
            response = await client.post("/generate", timeout=600, json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": COMPLETION, "ignore_eos": True,
                                    "temperature": 1.0, "sampling_seed": 3}})
            assert response.status == 200, await response.text()
            body = await response.json()
            seconds = time.perf_counter() - start
            # A sequence longer than the pool can ever hold (81 pages), though within
            # max_seq_len: refused before it costs anything, naming the cache.
            refused = await client.post("/generate", json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": PAGES * PAGE}})
            message = (await refused.json())["error"]["message"]
            assert refused.status == 400, message
            assert (f"needs {PAGES + 1} KV-cache pages of {PAGE} tokens, more than the whole "
                    f"cache holds ({PAGES} pages") in message, message
            too_long = await client.post("/generate", json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_SEQ_LEN}})
            assert too_long.status == 400 and "max_seq_len" in (
                await too_long.json())["error"]["message"]
            healthy = await client.get("/health")
            assert healthy.status == 200
            return body, seconds

    body, seconds = asyncio.run(main())
    print(f"{COMPLETION} tokens in {seconds:.1f} s")
    meta = body["meta_info"]
    assert meta["completion_tokens"] == COMPLETION and meta["finish_reason"]["type"] == "length"
    ids = body["output_ids"]
    logprobs = np.array([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert len(ids) == len(logprobs) == COMPLETION
    usage = server.engine.cache_usage()
    assert usage["free_pages"] == usage["pages"] == PAGES  # every page came back
    # The trainer's log-probs of the same tokens (float32): the cache kept every page right,
    # the last ones (positions past 4,000) included.
    from rl_jax.models.hf import load_pretrained
    model = load_pretrained(path, None, jnp.float32)
    tokens = jnp.asarray([prompt + ids[:-1]])
    targets = jnp.asarray([prompt[1:] + ids])
    reference, _ = model.token_logprobs(tokens, targets)
    np.testing.assert_allclose(logprobs, np.asarray(reference[0, PROMPT - 1:]), atol=1e-4)


def test_the_systems_model_plans_the_engines_page_pool(served):
    """``generator_memory`` with the server's budget: the KV cache term equals the bytes of the
    engine's real page arrays, and its tokens the pool's."""
    from rl_jax.sysmodel.memory_serving import generator_memory
    from rl_jax.sysmodel.shape import ModelShape
    server, cfg, budget, _ = served
    runner = server.engine.runners[0]
    allocated = sum(x.nbytes for x in (*runner.k_cache, *runner.v_cache))
    planned = generator_memory(ModelShape.from_model_config(cfg), max_slots=2,
                               max_seq_len=MAX_SEQ_LEN, dtype="float32", page_size=PAGE,
                               kv_cache_bytes=budget)
    assert planned.terms["kv_cache"] == allocated == runner.cache_bytes
    assert planned.notes["kv_pages"] == PAGES and planned.notes["kv_tokens"] == PAGES * PAGE
    # Without a budget: every slot's max_seq_len, as the engine would allocate it.
    whole = generator_memory(ModelShape.from_model_config(cfg), max_slots=2,
                             max_seq_len=MAX_SEQ_LEN, dtype="float32", page_size=PAGE)
    assert whole.terms["kv_cache"] == 2 * (MAX_SEQ_LEN // PAGE) * runner.page_bytes(
        cfg, PAGE, jnp.float32)
