"""Worker side of the vLLM connector on real paged tensors and a real file store, without an engine: what it
stores and restores (per KV-cache group, skipping the blocks a sliding-window group dropped), what it reports to
vLLM as finished and failed loads, and that its DEBUG lines say what happened."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvtc.errors import ConfigError  # noqa: E402
from kvtc.integrations.vllm.codecs import Codecs  # noqa: E402
from kvtc.integrations.vllm.config import ConnectorConfig, ConnectorSetup, open_connector_store  # noqa: E402
from kvtc.integrations.vllm.groups import CacheGroup  # noqa: E402
from kvtc.integrations.vllm.metadata import LoadJob, StoreJob  # noqa: E402
from kvtc.integrations.vllm.worker import WorkerSide  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, CHUNK, BLOCKS = 2, 2, 16, 16, 32, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _worker(
    store_url: str,
    seed: int | None = None,
    groups: tuple[CacheGroup, ...] = (),
    background: bool = False,
    max_pending_bytes: int = 1 << 30,
    before_attach: Any = None,
) -> WorkerSide:
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
        groups=groups,
    )
    g = torch.Generator().manual_seed(seed or 0)
    caches = {}
    for name in NAMES:
        c = torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).bfloat16()
        caches[name] = c if seed is not None else torch.zeros_like(c)
    store = open_connector_store(config, setup.namespace(0))
    w = WorkerSide(
        setup, Codecs(config, None, None), 0, store, background=background, max_pending_bytes=max_pending_bytes
    )
    if before_attach is not None:  # e.g. break the store the codec process is about to open
        before_attach()
    w.attach(caches, modules={}, cache_dtype="auto")
    return w


def _debug_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtc.vllm" and r.levelno == logging.DEBUG]


def test_store_then_restore_and_a_missing_chunk(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvtc.vllm")
    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=1, background=True)
    blocks = [5, 2, 7, 1]  # two chunks of two blocks each
    src.save([StoreJob("a", "key0", 0, [blocks[:2]])])
    assert _debug_lines(caplog)[-1].startswith(f"KVTCConnector: queued for storing {CHUNK} tokens in ")
    src.close()  # drains the background queue
    line = _debug_lines(caplog)[-1]
    assert line.startswith(f"KVTCConnector: stored {CHUNK} tokens in ") and " bytes" in line, line

    dst = _worker(url, background=True)  # restores of two chunks or more: the codec process decodes the second half
    other = [3, 4, 6, 8]
    dst.load([LoadJob("b", [other], 0, 2 * CHUNK, ["key0", "key-never-stored"], 0)])
    line = _debug_lines(caplog)[-1]
    assert line.startswith("KVTCConnector: restored 0 tokens in "), line  # chunk 1 failed: the request is redone
    assert f"{2 * CHUNK} tokens not restored" in line, line
    assert dst.take_finished_loads() == ({"b"}, {"b"})  # finished, and failed: vLLM recomputes the request
    assert dst.take_finished_loads() == (set(), set())
    report = dst.take_report()
    assert report is not None and report.bad_keys == {"key-never-stored"}  # never offered again
    assert not any(dst.layers[i].cache.any() for i in range(LAYERS))  # nothing written for a failed request

    dst.load([LoadJob("c", [other], 0, CHUNK, ["key0"], 0)])
    assert dst.take_finished_loads() == ({"c"}, set())
    assert _debug_lines(caplog)[-1].startswith(f"KVTCConnector: restored {CHUNK} tokens in ")
    for i in range(LAYERS):  # chunk 0 landed in the new blocks exactly, the other blocks untouched
        s, d = src.layers[i].cache, dst.layers[i].cache
        assert torch.equal(d[3], s[5]) and torch.equal(d[4], s[2])
        assert not d[6].any() and not d[8].any()
    dst.close()


def test_a_restore_split_with_the_codec_process(tmp_path):
    """Three chunks: the worker decodes the first two, the codec process the third; all land exactly, and a load
    that starts inside its first chunk writes only its own tokens."""
    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=6)
    ids = [1, 2, 3, 4, 5, 6]
    src.save([StoreJob("a", f"k{c}", c, [ids]) for c in range(3)])
    dst = _worker(url, background=True)
    new = [7, 8, 9, 10, 11, 2]
    dst.load([LoadJob("b", [new], 0, 3 * CHUNK, ["k0", "k1", "k2"], 0)])
    dst.load([LoadJob("c", [[0, 3, 4, 5]], BLOCK, 2 * CHUNK, ["k0", "k1"], 0)])  # tokens 16..63 (block 0 local)
    assert dst.take_finished_loads() == ({"b", "c"}, set())
    for i in range(LAYERS):
        s, d = src.layers[i].cache, dst.layers[i].cache
        for a, b in zip(ids, new):
            assert torch.equal(d[b], s[a])
        assert torch.equal(d[3], s[2]) and torch.equal(d[4], s[3]) and torch.equal(d[5], s[4])
        assert not d[0].any()
    dst.close()


def test_a_damaged_entry_is_removed_and_reported(tmp_path):
    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=3)
    src.save([StoreJob("a", "key0", 0, [[1, 2]])])
    assert src.store.put("key0", src.store.get("key0")[:-7])  # a truncated blob: the decoder refuses it
    dst = _worker(url)
    dst.load([LoadJob("b", [[3, 4]], 0, CHUNK, ["key0"], 0)])
    assert dst.take_finished_loads() == ({"b"}, {"b"})
    assert dst.take_report().bad_keys == {"key0"}
    assert not dst.store.contains("key0")  # stored again when this engine computes those tokens


def test_a_refused_put_is_not_reported_as_stored(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvtc.vllm")
    w = _worker(f"file://{tmp_path}/small?max_bytes=1000", seed=2)  # a chunk is ~8 KB: the store refuses it
    w.save([StoreJob("a", "key0", 0, [[2, 3]])])
    line = _debug_lines(caplog)[-1]
    assert line.startswith("KVTCConnector: stored 0 tokens in "), line
    assert "bytes" not in line and "1 chunks refused by the store or dropped" in line, line
    assert not w.store.contains("key0")
    assert w.take_report().unsaved == {"key0"}  # the scheduler may submit it again


def test_groups_restore_into_their_own_blocks(tmp_path):
    """Layer 0 in a sliding-window group (window 48: holds 47 tokens, so 32-token chunks fit), layer 1 in a
    full-attention group. Restoring 64 tokens: the sliding group's table has vLLM's null block where the window
    no longer reaches (block 0 of the cache must stay untouched), the full group has all its blocks."""
    groups = (CacheGroup(BLOCK, (NAMES[0],), window=48), CacheGroup(BLOCK, (NAMES[1],)))
    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=4, groups=groups)
    assert src.layout.max_tokens == (47, 0)  # the calibration's convention: window - 1
    src_ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    src.save([StoreJob("a", "k0", 0, src_ids), StoreJob("a", "k1", 1, src_ids)])
    dst = _worker(url, groups=groups)
    dst_ids = [[0, 0, 9, 10], [2, 3, 4, 11]]  # sliding group: the first two blocks dropped (null)
    dst.load([LoadJob("b", dst_ids, 0, 2 * CHUNK, ["k0", "k1"], 0)])
    assert dst.take_finished_loads() == ({"b"}, set())
    s0, d0 = src.layers[0].cache, dst.layers[0].cache
    s1, d1 = src.layers[1].cache, dst.layers[1].cache
    assert torch.equal(d0[9], s0[3]) and torch.equal(d0[10], s0[4])
    assert not d0[0].any() and not d0[2].any()  # null block and the other group's blocks untouched
    for a, b in zip([5, 6, 7, 8], [2, 3, 4, 11]):
        assert torch.equal(d1[b], s1[a])
    assert not d1[9].any() and not d1[10].any()


def test_a_chunk_longer_than_a_window_is_refused(tmp_path):
    groups = (CacheGroup(BLOCK, (NAMES[0],), window=24), CacheGroup(BLOCK, (NAMES[1],)))
    with pytest.raises(ConfigError, match=r"chunk_tokens=32 is longer than the 23 tokens .* such as 16"):
        _worker(f"file://{tmp_path}/store", groups=groups)


def test_encoder_process_queue_is_bounded(tmp_path, caplog):
    """Chunks wait for the encoder process in shared-memory copies, at most ``max_pending_bytes`` of them (one chunk
    is ~8 KB here): the second chunk, submitted while the first waits for the process to start, is dropped and
    reported; the first is stored before the worker closes."""
    caplog.set_level(logging.DEBUG, logger="kvtc.vllm")
    w = _worker(f"file://{tmp_path}/store", seed=5, background=True, max_pending_bytes=10_000)
    w.save([StoreJob("a", "k0", 0, [[1, 2]]), StoreJob("a", "k1", 1, [[1, 2, 3, 4]])])
    assert "1 chunks refused by the store or dropped" in _debug_lines(caplog)[-1]
    assert w.take_report().unsaved == {"k1"}
    copies = Path(w.helper.dir)
    w.close()
    assert w.store.contains("k0") and not w.store.contains("k1")
    assert not copies.exists()  # the shared-memory copies are gone


def _idle_threads(pid: int) -> list[int]:
    idle = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if os.sched_getscheduler(int(task.name)) == os.SCHED_IDLE:
                idle.append(int(task.name))
        except OSError:  # the thread ended meanwhile
            pass
    return idle


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not Path("/proc/self/task").is_dir(), reason="needs Linux")
def test_saving_runs_at_idle_priority_until_the_worker_closes(tmp_path):
    """The codec process saves in a SCHED_IDLE thread while the engine serves; once the worker closes (shutdown
    waits for the queue, and vLLM allows it only seconds) that thread runs at normal priority."""
    w = _worker(f"file://{tmp_path}/store", seed=6, background=True)
    w.save([StoreJob("a", "k0", 0, [[1, 2]])])
    pid = w.helper.proc.pid
    deadline = time.monotonic() + 60
    while not (idle := _idle_threads(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(idle) == 1, "no saving thread at SCHED_IDLE"
    w.helper.hurry()
    while _idle_threads(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _idle_threads(pid) and idle[0] in [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    w.close()
    assert w.store.contains("k0")


def test_connector_stats_count_what_happened(tmp_path):
    """The counters vLLM collects (``get_kv_connector_stats``) add up what was stored, refused, restored and
    recomputed, byte for byte, and are emptied by each collection."""
    from kvtc.integrations.vllm.connector import KVTCConnector, KVTCStats

    url = f"file://{tmp_path}/store"
    src = _worker(url, seed=4)
    src.save([StoreJob("a", "k0", 0, [[1, 2, 3, 4]]), StoreJob("a", "k1", 1, [[1, 2, 3, 4]])])
    taken = src.tally.take()
    sizes = len(src.store.get("k0")) + len(src.store.get("k1"))
    assert taken["stored_chunks"] == 2 and taken["stored_tokens"] == 2 * CHUNK and taken["stored_bytes"] == sizes
    assert src.tally.take()["stored_chunks"] == 0  # emptied by the collection

    dst = _worker(url)
    dst.load([LoadJob("b", [[5, 6, 7, 8]], 0, 2 * CHUNK, ["k0", "k1"], 0)])
    dst.load([LoadJob("c", [[9, 10]], 0, CHUNK, ["never-stored"], 0)])
    got = dst.tally.take()
    assert got["restored_tokens"] == 2 * CHUNK and got["restore_failed_tokens"] == CHUNK

    small = _worker(f"file://{tmp_path}/small?max_bytes=1000", seed=2)  # the store refuses ~8 KB chunks
    small.save([StoreJob("a", "k0", 0, [[2, 3]])])
    refused = small.tally.take()
    assert refused["saves_refused"] == 1 and refused["stored_chunks"] == 0

    total = (
        KVTCConnector.build_kv_connector_stats(taken).aggregate(KVTCStats(data=got)).aggregate(KVTCStats(data=refused))
    )
    r = total.reduce()
    assert (r["stored_tokens"], r["restored_tokens"], r["saves_refused"]) == (2 * CHUNK, 2 * CHUNK, 1)
    assert r["stored_bytes_per_token"] == round(sizes / (2 * CHUNK), 1)
    assert not total.is_empty() and KVTCConnector.build_kv_connector_stats(None).is_empty()
    total.reset()
    assert total.is_empty()


def _token_map_codecs(tmp_path: Path) -> tuple[Codecs, ConnectorConfig, torch.Tensor]:
    """kvtc codecs of a calibration with a token map for the tiny Llama the workers' caches stand for, whose
    checkpoint (safetensors, as vLLM serves it) lies in ``tmp_path/tiny``; and that model's embedding table."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    import tiny_models
    from kvtc.calibration import Recipe, fit_calibration
    from kvtc.calibration.token_map import LAGS, TokenMap, probe_ids
    from kvtc.integrations.hf import describe_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_models.llama())
    model.save_pretrained(tmp_path / "tiny")
    layout, rope = describe_model(model)
    layout = dataclasses.replace(layout, dtype="bfloat16")
    g = torch.Generator().manual_seed(3)
    rows = [(torch.randn(512, layout.num_features, generator=g), torch.randn(512, layout.num_features, generator=g))]
    cal = fit_calibration(layout, rows, Recipe(ratios=(4, 8), dp_rows=256), rope=rope.to_dict(), model_id="tiny")
    emb = model.get_input_embeddings().weight.detach()
    f, p = LAGS * emb.shape[1], layout.num_features
    weights = {k: (torch.randn(f, p, generator=g) * 0.05).half() for k in ("keys", "values")}
    tm = TokenMap.from_weights(
        LAGS,
        emb.shape[0],
        emb.float().mean(0).repeat(LAGS),
        torch.ones(f),
        weights,
        emb[probe_ids(emb.shape[0])].float(),
    )
    cal = dataclasses.replace(cal, token_map=tm)
    path = cal.save(tmp_path / "tiny.safetensors")
    config = ConnectorConfig(
        codec="kvtc", calibration=str(path), ratio=4, store=f"file://{tmp_path}/store", chunk_tokens=CHUNK, sinks=0
    )
    return Codecs(config, cal, rope, "the tiny model", checkpoint=str(tmp_path / "tiny")), config, emb


@pytest.mark.parametrize("background", [False, True])
def test_a_token_map_calibration_stores_each_chunk_with_its_ids(tmp_path, background):
    """The scheduler's token ids reach the encoder (inline or in the codec process), the blob carries them, and a
    fresh worker restores the chunk with the embeddings it reads from the checkpoint; a chunk without ids is not
    stored (a failed save, never a blob coded against the wrong prediction)."""
    from kvtc.codec import Codec

    codecs, config, _ = _token_map_codecs(tmp_path)
    setup = ConnectorSetup(config, model="tiny", model_dtype="torch.bfloat16", block_size=BLOCK, tp_size=1,
                           total_kv_heads=HEADS, head_dim=DIM)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    caches = {name: torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).bfloat16() for name in NAMES}

    def worker(cs, fill):
        w = WorkerSide(setup, cs, 0, open_connector_store(config, setup.namespace(0)), background=background)
        w.attach({n: c.clone() if fill else torch.zeros_like(c) for n, c in caches.items()}, {}, "auto")
        return w

    src = worker(codecs, True)
    ids = list(range(3, 3 + CHUNK))
    src.save([StoreJob("a", "k0", 0, [[5, 2]], ids), StoreJob("a", "k1", 1, [[5, 2, 7, 1]])])
    src.close()
    assert src.tally.take()["save_failures"] == 1  # k1 came without its ids
    blob = src.store.get("k0")
    assert Codec.inspect(blob)["version"] == 5 and src.store.get("k1") is None

    fresh = Codecs(config, codecs.calibration, codecs.rope, "the tiny model", checkpoint=str(tmp_path / "tiny"))
    dst = worker(fresh, False)
    # warm from the start: both chunks' codecs and the checkpoint's embeddings are loaded before the first load
    assert len(fresh._by_layout) == 2 and fresh._embeddings is not None
    dst.load([LoadJob("b", [[3, 4]], 0, CHUNK, ["k0"], 0)])
    assert dst.take_finished_loads() == ({"b"}, set())
    assert torch.equal(dst.chunks.codecs.codec(src.layout, True).decode(blob).token_ids[0], torch.tensor(ids))
    for i, name in enumerate(NAMES):
        want = torch.cat([caches[name][5], caches[name][2]], 1).float()  # [heads, 32, 2 * dim]
        got = torch.cat([dst.layers[i].cache[3], dst.layers[i].cache[4]], 1).float()
        rel = float((got - want).norm() / want.norm())
        assert rel < 0.9, (name, rel)  # random K/V at 4x: lossy, but the chunk's own
    dst.close()


def test_a_token_map_calibration_needs_the_checkpoints_embeddings(tmp_path):
    codecs, config, _ = _token_map_codecs(tmp_path)
    bare = Codecs(config, codecs.calibration, codecs.rope, "the tiny model", checkpoint=str(tmp_path / "nowhere"))
    lay = codecs.calibration.layout
    with pytest.raises(ConfigError, match="input embeddings"):
        bare.check(lay)
    (tmp_path / "other").mkdir()
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(7, 3)}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(ConfigError, match="no input embedding table"):
        Codecs(config, codecs.calibration, codecs.rope, "x", checkpoint=str(tmp_path / "other")).check(lay)
    codecs.check(lay)  # the real checkpoint: found by name and shape


# -- faults: none reaches the engine ---------------------------------------------------------------------------
def _break(root: Path) -> None:
    """Make the file store at ``root`` unusable (a regular file where its directory was; permissions would not stop
    a test running as root)."""
    shutil.rmtree(root, ignore_errors=True)
    root.write_bytes(b"not a directory")


def _mend(root: Path) -> None:
    root.unlink()
    root.mkdir()


def _wait(predicate: Any, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_codec_process_is_started_again_and_saving_resumes(tmp_path, monkeypatch):
    """Killing the codec process loses only what it held: the next save inside its restart pause is dropped and
    counted, nothing raises, and the process is started again (with the layers it needs) on the save after."""
    import kvtc.integrations.vllm.helper as helper_mod

    monkeypatch.setattr(helper_mod, "RESTART_BACKOFF_S", 0.5)
    w = _worker(f"file://{tmp_path}/store", seed=7, background=True)
    w.save([StoreJob("a", "k0", 0, [[1, 2]])])
    w.helper.flush(60)
    assert w.store.contains("k0")
    first = w.helper.proc.pid
    os.kill(first, signal.SIGKILL)
    _wait(lambda: not w.helper.alive)
    w.save([StoreJob("a", "k1", 0, [[3, 4]])])  # inside the pause: dropped, reported as not stored
    assert w.take_report().unsaved == {"k1"} and w.tally.take()["saves_refused"] == 1
    time.sleep(0.6)
    w.save([StoreJob("a", "k2", 1, [[1, 2, 3, 4]])])  # started again, with the setup and the probed layers
    assert w.helper.restarts == 1 and w.helper.proc.pid != first
    w.helper.flush(60)
    w.load([LoadJob("b", [[5, 6, 7, 8]], 0, 2 * CHUNK, ["k0", "k2"], 0)])  # its half of a restore works too
    assert w.take_finished_loads() == ({"b"}, set())
    w.close()
    assert w.store.contains("k2") and not w.store.contains("k1")


def test_a_store_that_fails_before_the_codec_process_opens_it_stops_nothing(tmp_path, monkeypatch, caplog):
    """The store breaks between the engine's start and the codec process opening it: the process exits, saves are
    dropped and counted (never a broken pipe into the engine), loads fall back to the worker; once the store is back
    the process is started again and saving resumes."""
    import kvtc.integrations.vllm.helper as helper_mod

    monkeypatch.setattr(helper_mod, "RESTART_BACKOFF_S", 0.5)
    monkeypatch.setattr(helper_mod, "RESTART_BACKOFF_MAX_S", 1.0)
    root = tmp_path / "store"
    w = _worker(f"file://{root}", seed=8, background=True, before_attach=lambda: _break(root))
    _wait(lambda: not w.helper.alive)  # the process could not open the store
    w.save([StoreJob("a", "k0", 0, [[1, 2]])])  # the first save also probes the layers: nothing raises
    w.helper.flush(60)
    assert w.take_report().unsaved == {"k0"}
    w.load([LoadJob("b", [[5, 6, 7, 8]], 0, 2 * CHUNK, ["k0", "k1"], 0)])  # recomputed, not an error
    assert w.take_finished_loads() == ({"b"}, {"b"})
    _mend(root)
    deadline = time.monotonic() + 60
    while not w.store.contains("k1"):  # started again after its pause, it stores again
        assert time.monotonic() < deadline, "saving did not resume"
        w.save([StoreJob("a", "k1", 0, [[1, 2]])])
        w.helper.flush(60)
        time.sleep(0.2)
    w.close()
    assert w.helper.restarts >= 1


def test_while_the_store_refuses_saves_no_chunk_is_copied_or_encoded(tmp_path, monkeypatch):
    """A refused save opens the breaker: for BREAKER_S no chunk is copied or encoded (each is dropped and counted at
    once), the refused chunk not even after; when it closes and the store is back, saving resumes; a stored chunk is
    never copied again."""
    import kvtc.integrations.vllm.helper as helper_mod

    monkeypatch.setattr(helper_mod, "BREAKER_S", 5.0)
    root = tmp_path / "store"
    w = _worker(f"file://{root}", seed=9, background=True)
    w.save([StoreJob("a", "k0", 0, [[1, 2]])])
    w.helper.flush(60)
    w.save([StoreJob("a", "k0", 0, [[1, 2]])])  # already stored: not copied again
    assert w.helper.skipped == 1 and w.helper.pending == 0
    _break(root)
    w.save([StoreJob("a", "k1", 0, [[3, 4]])])
    w.helper.flush(60)  # refused: the breaker opens
    copies = len(list(Path(w.helper.dir).iterdir()))
    w.save([StoreJob("a", f"k{i}", 0, [[1, 2]]) for i in range(2, 6)])
    assert w.helper.skipped == 5 and w.helper.pending == 0
    assert len(list(Path(w.helper.dir).iterdir())) == copies  # nothing copied
    assert w.take_report().unsaved == {"k1", "k2", "k3", "k4", "k5"}
    _mend(root)
    time.sleep(5.1)
    w.save([StoreJob("a", "k6", 0, [[1, 2]])])
    w.close()
    assert w.store.contains("k6") and not w.store.contains("k2")
