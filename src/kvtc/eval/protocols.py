"""The three evaluation protocols of ``kvtc eval``, on any Hugging Face causal LM.

1. :func:`storage_roundtrip`: prefill a context, compress every token but the sinks and the recent window,
   put the lossy cache back and score a continuation with teacher forcing against the exact cache.
2. :func:`conversation`: the paper's simulated conversation: while teacher-forcing a long text, the tokens
   that leave the raw window are compressed every ``step`` tokens (the raw tail stays between
   ``window - step`` and ``window`` tokens), so every prediction after the first window sees lossy history.
3. :func:`retrieval`: needle prompts, greedy answers from the exact and the lossy cache, exact-match accuracy:
   pass-key prompts (:func:`passkey_prompts`: one needle sentence at a depth of a haystack, the classic repeated
   filler or evaluation text) and RULER-style needles (:func:`needle_prompts`: one, or four similar key-value
   needles at spread depths of which one is queried).

The storage round trip also scores the *copy tokens* of each window (:func:`copy_tokens`): the continuation
tokens whose bigram occurs in the compressed span of the context but in none of the tokens the cache keeps exact
before them (the newest ``window`` context tokens and the continuation so far). Such a token is what a model copies
from the middle of its context (a name, a number, a rare word): the case a mean over all tokens hides. The rule
was written down before any figure was measured with it.

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
    #: storage round trip, one entry per window in window order (the same windows for every method): the mean KL
    #: over its scored tokens, and (summed KL, count) over its copy tokens
    window_kl: list[float] = field(default_factory=list)
    window_copy: list[tuple[float, int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add_scores(
        self,
        exact_logp: torch.Tensor,
        lossy_logp: torch.Tensor,
        targets: torch.Tensor,
        copy: torch.Tensor | None = None,
    ) -> None:
        """Score one window's (or prompt's) tokens. ``copy``: the window's copy-token mask (:func:`copy_tokens`),
        given for a storage round-trip window, whose KL is then also kept per window."""
        kl = (exact_logp.exp() * (exact_logp - lossy_logp)).sum(-1)
        self.tokens += int(targets.numel())
        self.nll -= float(lossy_logp.gather(-1, targets[:, None]).sum())
        self.nll_exact -= float(exact_logp.gather(-1, targets[:, None]).sum())
        self.kl += float(kl.sum())
        self.agree += int((exact_logp.argmax(-1) == lossy_logp.argmax(-1)).sum())
        if copy is not None:
            self.window_kl.append(float(kl.mean()))
            self.window_copy.append((float(kl[copy].sum()), int(copy.sum())))

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

    def _worst_case(self) -> dict[str, Any]:
        """Per-window KL with its maximum and 90th percentile; the copy tokens' pooled KL and each window's."""
        if not self.window_kl:
            return {}
        w = torch.tensor(self.window_kl, dtype=torch.float64)
        out: dict[str, Any] = {
            "kl_windows": self.window_kl,
            "kl_max": float(w.max()),
            "kl_p90": float(torch.quantile(w, 0.9)),  # linear between order statistics
        }
        n = sum(c for _, c in self.window_copy)
        out["copy_tokens"] = n
        out["copy_windows"] = sum(1 for _, c in self.window_copy if c)
        if n:
            out["copy_kl"] = sum(s for s, _ in self.window_copy) / n
            out["copy_kl_windows"] = [s / c if c else None for s, c in self.window_copy]
        return out

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
            out.update(self._worst_case())
            if self.has_error and self.sq_norm["keys"]:
                for kind in KINDS:
                    out[f"{kind[0]}_rel_error"] = (self.sq_error[kind] / self.sq_norm[kind]) ** 0.5
                for key, norm in sorted(self.sq_norm_type.items()):
                    kind, layers = key.split(".")
                    out[f"{kind[0]}_rel_error_{layers}"] = (self.sq_error_type[key] / max(norm, 1e-300)) ** 0.5
        if self.prompts:
            out.update(
                prompts=self.prompts,
                correct=self.correct,
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
        copy = copy_tokens(ids.cpu(), context, sinks, window).to(ids.device)
        cache = _prefill(model, ctx)
        kv = extract_slice(cache, model)
        kv.token_ids = ctx[None].to(device="cpu", dtype=torch.int64)
        exact = _logp(model, cont, cache)
        tallies["exact"].add_scores(exact, exact, targets, copy)
        for m in methods:
            res = m.compress(kv, sinks, context - window, rope)
            lossy_cache = rebuild_cache(res.kv, model)
            lossy = _logp(model, cont, lossy_cache, attention_mask(res.keep, cont.numel()))
            t = tallies[m.label]
            t.add_scores(exact, lossy, targets, copy)
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


def copy_tokens(ids: torch.Tensor, context: int, sinks: int = 4, window: int = 128) -> torch.Tensor:
    """The copy tokens of a storage round-trip window ``ids`` (``[context + continuation + 1]``): a bool mask over
    its scored targets ``ids[context + 1:]``.

    Target ``ids[p]`` is a copy token when its bigram ``(ids[p - 1], ids[p])`` occurs inside the compressed span
    ``ids[sinks:context - window]`` and nowhere in the exact tokens before it, ``ids[context - window:p]`` (the
    newest ``window`` context tokens and the continuation fed so far)."""
    seq = ids.tolist()
    lossy = set(zip(seq[sinks : context - window - 1], seq[sinks + 1 : context - window]))
    exact = set(zip(seq[context - window : context], seq[context - window + 1 : context + 1]))
    mask = []
    for p in range(context + 1, len(seq)):
        pair = (seq[p - 1], seq[p])
        mask.append(pair in lossy and pair not in exact)
        exact.add(pair)
    return torch.tensor(mask, dtype=torch.bool)


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
    depth: float  # of the queried needle
    needle_position: int  # token index where the queried needle starts
    kind: str = "passkey"  # or a RULER-style kind of NEEDLE_KINDS


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
    hay = _haystack(tokenizer, haystack_texts, max(lengths))
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


# RULER-style needles (Hsieh et al., 2024, "niah_single" / "niah_multikey"): a key word and a seven-digit value
NEEDLE_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "\nOne of the special magic numbers for {key} is: {value}.\n"
NEEDLE_QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
#: needle kinds: how many needles a prompt holds (one of them is queried)
NEEDLE_KINDS = {"single": 1, "multikey": 4}
#: the keys needles are drawn from: plain words of one kind (animals), so the four needles of a multi-key prompt
#: are alike and only the key tells them apart
NEEDLE_KEYS = (
    "badger", "beaver", "bison", "camel", "cheetah", "coyote", "donkey", "eagle", "falcon", "ferret", "gazelle",
    "giraffe", "gorilla", "hamster", "hedgehog", "heron", "jackal", "jaguar", "koala", "lemur", "leopard", "lizard",
    "llama", "lobster", "mole", "moose", "otter", "panther", "parrot", "pelican", "penguin", "pigeon", "rabbit",
    "raccoon", "raven", "salmon", "seal", "shark", "sparrow", "spider", "squirrel", "swan", "tiger", "turkey",
    "turtle", "walrus", "weasel", "whale", "wolf", "zebra",
)  # fmt: skip


def needle_prompts(
    tokenizer: Any, haystack_texts: Sequence[str], length: int, kind: str, count: int, seed: int = 0
) -> list[Prompt]:
    """``count`` RULER-style needle prompts of exactly ``length`` tokens: intro, haystack holding
    ``NEEDLE_KINDS[kind]`` needles (distinct keys, seven-digit values), question about one of them.

    The needles sit at evenly spread depths (single: 0.1 to 0.9 across the prompts; four needles: 0.2, 0.4, 0.6,
    0.8, each shifted by up to 0.05) and the queried one rotates over them, so every depth is asked about."""
    if kind not in NEEDLE_KINDS:
        raise ValueError(f"unknown needle kind {kind!r}; use one of {', '.join(NEEDLE_KINDS)}")
    n = NEEDLE_KINDS[kind]
    rng = random.Random(seed)
    enc = lambda s: tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
    hay = _haystack(tokenizer, haystack_texts, length)
    intro = enc(NEEDLE_INTRO)
    prompts = []
    for i in range(count):
        keys = rng.sample(NEEDLE_KEYS, n)
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        if n == 1:
            depths = [0.1 + 0.8 * i / max(1, count - 1)]
        else:
            depths = [(j + 1) / (n + 1) + rng.uniform(-0.05, 0.05) for j in range(n)]
        asked = i % n
        needles = [enc(NEEDLE.format(key=k, value=v)) for k, v in zip(keys, values)]
        question = enc(NEEDLE_QUESTION.format(key=keys[asked]))
        fill = length - len(intro) - len(question) - sum(map(len, needles))
        if fill <= 0:
            raise ValueError(f"a needle prompt of {length} tokens has no room for a haystack")
        off = rng.randrange(0, max(1, len(hay) - fill))
        h = hay[off : off + fill]
        ids, last, where = list(intro), 0, 0
        for j, (d, needle) in enumerate(zip(depths, needles)):
            cut = int(round(d * fill))
            ids += h[last:cut]
            if j == asked:
                where = len(ids)
            ids += needle
            last = cut
        ids += h[last:] + question
        prompts.append(Prompt(torch.tensor(ids, dtype=torch.int64), values[asked], length, depths[asked], where, kind))
    return prompts


def _haystack(tokenizer: Any, texts: Sequence[str], length: int) -> list[int]:
    """Token ids of ``texts`` joined by EOS, enough for prompts of ``length`` tokens at varied offsets."""
    hay: list[int] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for t in texts:
        hay.extend(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"] + eos)
        if len(hay) > 4 * length + 10_000:
            break
    return hay


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
            "kind": p.kind,
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
