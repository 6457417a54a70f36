"""The three evaluation protocols of ``kvtc eval``, on any Hugging Face causal LM.

1. :func:`storage_roundtrip`: prefill a context, compress every token but the sinks and the recent window,
   put the lossy cache back and score a continuation with teacher forcing against the exact cache.
2. :func:`conversation`: the paper's simulated conversation: while teacher-forcing a long text, the tokens
   that leave the raw window are compressed every ``step`` tokens (the raw tail stays between
   ``window - step`` and ``window`` tokens), so every prediction after the first window sees lossy history.
3. :func:`retrieval`: pass-key prompts (a needle sentence hidden at a depth of a haystack: the classic repeated
   filler, or evaluation text),
   greedy answers from the exact and the lossy cache, exact-match accuracy.

Every prediction a lossy method is scored on is made *through* its lossy cache: a window of ``context``
tokens fills the cache and the next ``continuation`` tokens are fed on top of it, predicting the
``continuation`` tokens after them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ..calibration.artifact import KINDS
from ..integrations.hf import describe_model, extract_slice, rebuild_cache
from ..layout import KVSlice, dtype_name
from .decode import attention_mask, greedy_decode
from .methods import Method, reference_bytes

Progress = Callable[[int], None]


@dataclass
class Tally:
    """Running sums of one method over windows (or prompts)."""

    #: scored tokens, and the sums over them: negative log-likelihood (lossy, exact), KL(exact‖lossy), top-1 agreement
    tokens: int = 0
    nll: float = 0.0
    nll_exact: float = 0.0
    kl: float = 0.0
    agree: int = 0
    #: per kind ("keys", "values"): summed squared reconstruction error and squared norm of the exact KV
    sq_error: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    sq_norm: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    #: the same per kind of layer, ``"{kind}.full"`` / ``"{kind}.sliding"``, when the model has both
    sq_error_type: dict[str, float] = field(default_factory=dict)
    sq_norm_type: dict[str, float] = field(default_factory=dict)
    #: bytes stored, bytes before entropy coding, bytes of the 16-bit reference cache
    bytes: float = 0.0
    bytes_raw: float = 0.0
    bytes_ref: float = 0.0
    has_error: bool = True
    has_raw: bool = False
    correct: int = 0
    correct_exact: int = 0
    prompts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def add_scores(self, exact_logp: torch.Tensor, lossy_logp: torch.Tensor, targets: torch.Tensor) -> None:
        self.tokens += int(targets.numel())
        self.nll -= float(lossy_logp.gather(-1, targets[:, None]).sum())
        self.nll_exact -= float(exact_logp.gather(-1, targets[:, None]).sum())
        self.kl += float((exact_logp.exp() * (exact_logp - lossy_logp)).sum())
        self.agree += int((exact_logp.argmax(-1) == lossy_logp.argmax(-1)).sum())

    def add_bytes(self, kv: KVSlice, start: int, stop: int, stored: float, raw: float | None) -> None:
        """``stored`` bytes for the compressed tokens ``[start, stop)`` of ``kv`` (those its layers hold)."""
        self.bytes += stored
        self.bytes_ref += reference_bytes(kv, start, stop)
        if raw is not None:
            self.has_raw = True
            self.bytes_raw += raw

    def add_error(self, exact: KVSlice, lossy: KVSlice, start: int, stop: int) -> None:
        spans = exact.layout.spans
        for kind in KINDS:
            a = getattr(exact, kind)[:, start:stop].double()
            b = getattr(lossy, kind)[:, start:stop].double()
            err = (a - b).square().sum(dim=(0, 1, 3, 4))  # per layer; tokens a layer does not hold are 0 in both
            norm = a.square().sum(dim=(0, 1, 3, 4))
            self.sq_error[kind] += float(err.sum())
            self.sq_norm[kind] += float(norm.sum())
            if len(spans) > 1:
                for sp in spans:
                    key = f"{kind}.{'sliding' if sp.limit else 'full'}"
                    idx = list(sp.indices)
                    self.sq_error_type[key] = self.sq_error_type.get(key, 0.0) + float(err[idx].sum())
                    self.sq_norm_type[key] = self.sq_norm_type.get(key, 0.0) + float(norm[idx].sum())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.bytes:
            out["ratio"] = self.bytes_ref / self.bytes
        if self.has_raw and self.bytes_raw:
            out["ratio_before_entropy"] = self.bytes_ref / self.bytes_raw
        if self.tokens:
            ppl, ppl_exact = math.exp(self.nll / self.tokens), math.exp(self.nll_exact / self.tokens)
            out.update(
                tokens=self.tokens,
                ppl=ppl,
                ppl_exact=ppl_exact,
                delta_ppl_pct=100.0 * (ppl / ppl_exact - 1.0),
                kl=self.kl / self.tokens,
                top1_agreement=self.agree / self.tokens,
            )
            if self.has_error and self.sq_norm["keys"]:
                for kind in KINDS:
                    out[f"{kind[0]}_rel_error"] = (self.sq_error[kind] / self.sq_norm[kind]) ** 0.5
                for key, norm in sorted(self.sq_norm_type.items()):
                    kind, layers = key.split(".")
                    out[f"{kind[0]}_rel_error_{layers}"] = (self.sq_error_type[key] / max(norm, 1e-300)) ** 0.5
        if self.prompts:
            out.update(
                prompts=self.prompts,
                accuracy=self.correct / self.prompts,
                accuracy_exact=self.correct_exact / self.prompts,
                lost_vs_exact=self.correct_exact - self.correct,
            )
        out.update(self.extra)
        return out


def _logp(model: Any, ids: torch.Tensor, cache: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=ids[None], past_key_values=cache, attention_mask=mask, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _prefill(model: Any, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    return cache


def storage_roundtrip(
    model: Any,
    windows: torch.Tensor,
    methods: Sequence[Method],
    context: int,
    sinks: int = 4,
    window: int = 128,
    progress: Progress | None = None,
) -> dict[str, Tally]:
    """Protocol 1. ``windows``: int64 ``[count, context + continuation + 1]`` token ids.

    The cache of ``context`` tokens is compressed on ``[sinks, context - window)``; the next ``continuation``
    tokens are fed on top of it and score the ``continuation`` tokens after them.
    """
    _, rope = describe_model(model)
    tallies = {"exact": Tally()} | {m.label: Tally() for m in methods}
    for ids in windows:
        ctx, cont, targets = ids[:context], ids[context:-1], ids[context + 1 :]
        cache = _prefill(model, ctx)
        kv = extract_slice(cache, model)
        kv.token_ids = ctx[None].to(device="cpu", dtype=torch.int64)
        exact = _logp(model, cont, cache)
        tallies["exact"].add_scores(exact, exact, targets)
        for m in methods:
            res = m.compress(kv, sinks, context - window, rope)
            lossy_cache = rebuild_cache(res.kv, model)
            lossy = _logp(model, cont, lossy_cache, attention_mask(res.keep, cont.numel()))
            t = tallies[m.label]
            t.add_scores(exact, lossy, targets)
            t.add_bytes(kv, sinks, context - window, res.bytes, res.bytes_raw)
            if res.keep is None:
                t.add_error(kv, res.kv, sinks, context - window)
            else:
                t.has_error = False
            if progress:
                progress(1)
        if progress:
            progress(1)
    return tallies


def conversation(
    model: Any,
    texts: torch.Tensor,
    methods: Sequence[Method],
    sinks: int = 4,
    window: int = 128,
    step: int = 16,
    progress: Progress | None = None,
) -> dict[str, Tally]:
    """Protocol 2. ``texts``: int64 ``[count, length]``; predictions of tokens past ``sinks + window`` are
    scored. The cache holds the sinks, lossy history and a raw tail of ``window - step`` tokens between steps;
    each step feeds ``step`` tokens (so attention sees at most ``window`` raw tokens) and then compresses
    the ``step`` oldest raw tokens."""
    _, rope = describe_model(model)
    start = sinks + window
    tallies = {"exact": Tally()} | {m.label: Tally() for m in methods if not m.evicts}
    for ids in texts:
        with torch.inference_mode():
            full = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
        exact = full[start - 1 : -1]
        targets = ids[start:]
        tallies["exact"].add_scores(exact, exact, targets)
        for m in methods:
            if m.evicts:
                continue
            t = tallies[m.label]
            # the cache holds tokens [0, fed); feeding ids[fed] predicts ids[fed + 1]
            fed = start - 1
            cache = _prefill(model, ids[:fed])
            done = sinks  # tokens [sinks, done) are lossy already
            logps = []
            while fed < ids.numel() - 1:
                if fed - done >= window:
                    stop = fed - (window - step)
                    _compress_span(model, cache, m, done, stop, rope, t, ids[done:stop])
                    done = stop
                chunk = ids[fed : min(fed + step, ids.numel() - 1)]
                logps.append(_logp(model, chunk, cache))
                fed += chunk.numel()
            lossy = torch.cat(logps)
            n = lossy.shape[0]
            t.add_scores(exact[:n], lossy, targets[:n])
            if progress:
                progress(1)
        if progress:
            progress(1)
    return tallies


def _compress_span(
    model: Any, cache: DynamicCache, method: Method, a: int, b: int, rope: Any, tally: Tally, ids: torch.Tensor
) -> None:
    """Replace tokens ``[a, b)`` (ids ``ids``) of every KV layer of ``cache`` by ``method``'s lossy version (a
    sliding-window layer must still hold them: the protocol compresses recent spans)."""
    layout, _ = describe_model(model)
    offsets = []  # index in each layer's tensors of token 0 (a sliding layer holds only its newest tokens)
    for li in layout.layers:
        layer = cache.layers[li]
        off = int(getattr(layer, "cumulative_length", layer.keys.shape[2])) - int(layer.keys.shape[2])
        if a < off:
            raise ValueError(f"layer {li} no longer holds token {a}; compress spans within its window")
        offsets.append(off)
    spans = [(a - off, b - off) for off in offsets]
    keys = torch.stack(
        [cache.layers[li].keys[:, :, x:y].transpose(1, 2) for li, (x, y) in zip(layout.layers, spans)], 2
    )
    values = torch.stack(
        [cache.layers[li].values[:, :, x:y].transpose(1, 2) for li, (x, y) in zip(layout.layers, spans)], 2
    )
    positions = torch.arange(a, b, device=keys.device).expand(keys.shape[0], b - a).contiguous()
    layout = dataclasses.replace(layout, dtype=dtype_name(keys.dtype))
    token_ids = ids[None].to(device="cpu", dtype=torch.int64).expand(keys.shape[0], b - a).contiguous()
    kv = KVSlice(layout, rope.invert(keys, positions, layout.layers), values, positions, token_ids=token_ids)
    res = method.compress(kv, 0, b - a, rope)
    tally.add_bytes(kv, 0, b - a, res.bytes, res.bytes_raw)
    tally.add_error(kv, res.kv, 0, b - a)
    lossy_keys = rope.apply(res.kv.keys, positions, layout.layers)
    with torch.inference_mode():  # the cache's tensors were made under inference mode
        for i, (li, (x, y)) in enumerate(zip(layout.layers, spans)):
            layer = cache.layers[li]
            layer.keys[:, :, x:y] = lossy_keys[:, :, i].transpose(1, 2).to(layer.keys.dtype)
            layer.values[:, :, x:y] = res.kv.values[:, :, i].transpose(1, 2).to(layer.values.dtype)


# ----------------------------------------------------------------------------------------- retrieval

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
#: the classic pass-key haystack (Mohtashami & Jaggi, 2023): a repeated filler the needle stands out from
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: haystacks of the retrieval protocol: "filler" (the classic pass-key test) or "text" (the evaluation text:
#: a needle in real prose, harder for small models)
HAYSTACKS = ("filler", "text")


@dataclass
class Prompt:
    ids: torch.Tensor  # int64 [length]
    answer: str
    length: int
    depth: float
    needle_position: int


def passkey_prompts(
    tokenizer: Any,
    haystack_texts: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    per_cell: int = 1,
    seed: int = 0,
) -> list[Prompt]:
    """Pass-key prompts of exactly ``length`` tokens: intro, haystack of real text with the needle at
    ``depth`` (a fraction of the haystack), question. ``per_cell`` prompts per (length, depth), each with its
    own five-digit key and haystack offset."""
    rng = random.Random(seed)
    enc = lambda s: tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
    hay: list[int] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for t in haystack_texts:
        hay.extend(enc(t) + eos)
        if len(hay) > 4 * max(lengths) + 10_000:
            break
    intro, question = enc(PASSKEY_INTRO), enc(PASSKEY_QUESTION)
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(per_cell):
                key = str(rng.randrange(10_000, 100_000))
                needle = enc(PASSKEY_NEEDLE.format(key=key))
                fill = length - len(intro) - len(question) - len(needle)
                if fill <= 0:
                    raise ValueError(f"a pass-key prompt of {length} tokens has no room for a haystack")
                off = rng.randrange(0, max(1, len(hay) - fill))
                h = hay[off : off + fill]
                cut = int(round(depth * fill))
                ids = intro + h[:cut] + needle + h[cut:] + question
                prompts.append(Prompt(torch.tensor(ids, dtype=torch.int64), key, length, depth, len(intro) + cut))
    return prompts


def _answer(model: Any, cache: Any, last: torch.Tensor, steps: int, keep: torch.Tensor | None) -> list[int]:
    return greedy_decode(model, last[None], cache, steps, keep=keep).tokens[0].tolist()


def _answer_ok(tokenizer: Any, generated: list[int], key: str) -> bool:
    text = tokenizer.decode(generated, skip_special_tokens=True)
    m = re.search(r"\d+", text)
    return m is not None and m.group() == key


def retrieval(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    methods: Sequence[Method],
    sinks: int = 4,
    window: int = 128,
    answer_tokens: int = 7,
    progress: Progress | None = None,
) -> tuple[dict[str, Tally], list[dict[str, Any]]]:
    """Protocol 3. The cache of every prompt token but the last is compressed on ``[sinks, len - 1 - window)``;
    the last prompt token is fed and ``answer_tokens`` tokens are decoded greedily. Returns tallies and
    one record per prompt."""
    _, rope = describe_model(model)
    tallies = {"exact": Tally()} | {m.label: Tally() for m in methods}
    records = []
    for p in prompts:
        ctx, last = p.ids[:-1], p.ids[-1:]
        n = ctx.numel()
        cache = _prefill(model, ctx)
        kv = extract_slice(cache, model)
        kv.token_ids = ctx[None].to(device="cpu", dtype=torch.int64)
        ok_exact = _answer_ok(tokenizer, _answer(model, cache, last, answer_tokens, None), p.answer)
        rec: dict[str, Any] = {
            "length": p.length,
            "depth": p.depth,
            "needle_position": p.needle_position,
            "in_compressed_span": sinks <= p.needle_position < n - window,
            "exact": ok_exact,
        }
        tallies["exact"].prompts += 1
        tallies["exact"].correct += ok_exact
        tallies["exact"].correct_exact += ok_exact
        for m in methods:
            res = m.compress(kv, sinks, n - window, rope)
            ok = _answer_ok(
                tokenizer, _answer(model, rebuild_cache(res.kv, model), last, answer_tokens, res.keep), p.answer
            )
            t = tallies[m.label]
            t.prompts += 1
            t.correct += ok
            t.correct_exact += ok_exact
            t.add_bytes(kv, sinks, n - window, res.bytes, res.bytes_raw)
            rec[m.label] = ok
            if progress:
                progress(1)
        records.append(rec)
        if progress:
            progress(1)
    return tallies, records
