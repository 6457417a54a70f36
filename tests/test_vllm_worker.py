"""Worker side of the vLLM connector on real paged tensors and a real file store, without an engine: what it
stores and restores, what it reports to vLLM as load errors, and that its DEBUG lines say what happened."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtc.integrations.vllm.codecs import Codecs  # noqa: E402
from kvtc.integrations.vllm.config import ConnectorConfig, ConnectorSetup, open_connector_store  # noqa: E402
from kvtc.integrations.vllm.metadata import LoadJob, StoreJob  # noqa: E402
from kvtc.integrations.vllm.worker import WorkerSide  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, CHUNK, BLOCKS = 2, 2, 16, 16, 32, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _worker(store_url: str, seed: int | None = None) -> WorkerSide:
    """A rank-0 worker with CPU-layout bf16 caches ([blocks, heads, block_size, 2 * head_dim]) per layer,
    random when ``seed`` is given, zero otherwise."""
    config = ConnectorConfig(codec="identity", store=store_url, chunk_tokens=CHUNK)
    setup = ConnectorSetup(
        config,
        model="tiny",
        model_dtype="torch.bfloat16",
        block_size=BLOCK,
        tp_size=1,
        total_kv_heads=HEADS,
        head_dim=DIM,
    )
    g = torch.Generator().manual_seed(seed or 0)
    caches = {}
    for name in NAMES:
        c = torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).bfloat16()
        caches[name] = c if seed is not None else torch.zeros_like(c)
    w = WorkerSide(setup, Codecs(config, None, None), 0, open_connector_store(config, setup.namespace(0)))
    w.attach(caches, modules={}, cache_dtype="auto")
    return w


def _debug_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtc.vllm" and r.levelno == logging.DEBUG]


def test_store_then_restore_and_a_missing_chunk(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvtc.vllm")
    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=1)
    blocks = [5, 2, 7, 0]  # two chunks of two blocks each
    src.save([StoreJob("a", "key0", 0, blocks[:2])])
    line = _debug_lines(caplog)[-1]
    assert line.startswith(f"KVTCConnector: stored {CHUNK} tokens in ") and " bytes" in line, line

    dst = _worker(url)
    other = [1, 3, 4, 6]
    dst.load([LoadJob("b", other, 0, 2 * CHUNK, ["key0", "key-never-stored"], 0)])
    line = _debug_lines(caplog)[-1]
    assert line.startswith(f"KVTCConnector: restored {CHUNK} tokens in "), line  # not 64: chunk 1 failed
    assert f"{CHUNK} tokens not restored" in line, line
    assert dst.take_load_errors() == {4, 6}  # the failed chunk's blocks go back to vLLM for recompute
    assert dst.take_load_errors() == set()
    for name in NAMES:  # chunk 0 landed in the new blocks exactly, chunk 1's blocks untouched
        s, d = src.layers[NAMES.index(name)].cache, dst.layers[NAMES.index(name)].cache
        assert torch.equal(d[1], s[5]) and torch.equal(d[3], s[2])
        assert not d[4].any() and not d[6].any()
    dst.save([StoreJob("b", "key1", 1, other)])  # the step that ran on the failed load stores nothing
    assert not dst.store.contains("key1")


def test_a_refused_put_is_not_reported_as_stored(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvtc.vllm")
    w = _worker(f"file://{tmp_path}/small?max_bytes=1000", seed=2)  # a chunk is ~8 KB: the store refuses it
    w.save([StoreJob("a", "key0", 0, [0, 1])])
    line = _debug_lines(caplog)[-1]
    assert line.startswith("KVTCConnector: stored 0 tokens in "), line
    assert "bytes" not in line and "1 chunks refused by the store" in line, line
    assert not w.store.contains("key0")
