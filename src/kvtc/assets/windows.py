"""Fixed-length token windows cut from documents, deterministically (seeded), in bounded memory."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import KVTCError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], length: int, count: int, seed: int = 0
) -> torch.Tensor:
    """``count`` windows of ``length`` token ids, ``[count, length]`` int64, chosen deterministically.

    Each window lies inside one document when enough documents are long enough (windows are spread over
    documents round-robin in a seeded order, at seeded offsets, never overlapping); otherwise windows
    are cut from the documents concatenated with the EOS token between them. Same inputs and seed give
    the same windows. :func:`iter_token_windows` yields them one by one.

    A window starts the way the model is run: with the tokens the tokenizer puts before a text (Gemma's BOS;
    none for SmolLM2), followed by ``length`` minus that many tokens of text (:func:`leading_ids`).
    """
    return torch.stack(list(iter_token_windows(tokenizer, texts, length, count, seed)))


def iter_token_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], length: int, count: int, seed: int = 0
) -> Iterator[torch.Tensor]:
    """The windows of :func:`token_windows`, ``[length]`` int64 each, in the same order, holding at most one
    document's tokens at a time: a first pass measures every document's token count, a second tokenizes only the
    documents windows are cut from (a corpus of any size is sampled in bounded memory). Only when too few documents
    are long enough, and windows are cut from all of them concatenated, is that concatenation built whole. The
    validation runs at the call, before the first window is yielded."""
    if length <= 0 or count <= 0:
        raise KVTCError(f"token_windows(): length and count must be positive, got {length=} {count=}")
    lead = leading_ids(tokenizer)
    if lead:
        if length <= len(lead):
            raise KVTCError(f"token_windows(): length {length} leaves no room after the leading tokens {lead}")
        body = _iter_windows(tokenizer, texts, length - len(lead), count, seed)
        prefix = torch.tensor(lead, dtype=torch.long)
        return (torch.cat([prefix, w]) for w in body)
    return _iter_windows(tokenizer, texts, length, count, seed)


def leading_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids the tokenizer puts before any text (a BOS token for Gemma, Llama 3; none for SmolLM2)."""
    full = tokenizer("", verbose=False)["input_ids"]  # an empty text: only what the tokenizer adds around it
    bare = tokenizer("", add_special_tokens=False, verbose=False)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    lead = list(full[: len(full) - len(bare)]) if full[len(full) - len(bare) :] == bare else []
    while lead and lead[-1] == eos:  # a tokenizer that also appends EOS: only what comes before the text
        lead.pop()
    return [int(t) for t in lead]


def _iter_windows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], length: int, count: int, seed: int
) -> Iterator[torch.Tensor]:
    """Windows of ``length`` text tokens (no leading tokens)."""

    def encode(text: str) -> list[int]:
        # Whole documents are longer than the model's context by design; only windows reach the model.
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    lengths = [len(encode(t)) for t in texts]
    rng = random.Random(seed)
    long_docs = [i for i, n in enumerate(lengths) if n >= length]
    if sum(lengths[i] // length for i in long_docs) >= count:
        picks = [(long_docs[j], s) for j, s in _window_slots([lengths[i] for i in long_docs], length, count, rng)]
        starts_by_doc: dict[int, list[int]] = {}
        for i, s in picks:
            starts_by_doc.setdefault(i, []).append(s)
        cut: dict[tuple[int, int], list[int]] = {}
        for i in sorted(starts_by_doc):
            ids = encode(texts[i])
            cut.update({(i, s): ids[s : s + length] for s in starts_by_doc[i]})
        return (torch.tensor(cut[p], dtype=torch.long) for p in picks)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if (sum(lengths) + len(sep) * len(texts)) // length < count:
        raise KVTCError(
            f"token_windows(): the texts hold {sum(lengths) + len(sep) * len(texts)} tokens, fewer than {count} "
            f"windows of {length}; use more text, fewer windows or shorter ones"
        )
    stream = [tok for t in texts for tok in encode(t) + sep]
    return (
        torch.tensor(stream[s : s + length], dtype=torch.long)
        for _, s in _window_slots([len(stream)], length, count, rng)
    )


def _window_slots(lengths: list[int], length: int, count: int, rng: random.Random) -> list[tuple[int, int]]:
    """``(document, start)`` of ``count`` windows in documents of ``lengths`` tokens, in draw order.

    Each document is divided into non-overlapping slots after a random shift; slots are drawn round-robin over a
    shuffled document order so windows come from as many documents as possible."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    slots_per_doc = []
    for i in order:
        n = lengths[i] // length
        shift = rng.randrange(lengths[i] - n * length + 1)
        starts = [shift + s * length for s in range(n)]
        rng.shuffle(starts)
        slots_per_doc.append((i, starts))
    picks: list[tuple[int, int]] = []
    while len(picks) < count:
        for i, starts in slots_per_doc:
            if starts and len(picks) < count:
                picks.append((i, starts.pop()))
    return picks
