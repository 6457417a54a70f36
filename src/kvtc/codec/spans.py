"""Which tokens of which layers a blob stores raw, codes, or leaves out, per :class:`~kvtc.layout.Span`.

A span is a set of layers that hold the same (newest) tokens: every layer of a dense model, or the sliding-window
layers of a model that mixes them with full-attention ones. For each span of a ``tokens``-long sequence the header
gives ``(first, sinks, window, middle)`` (:attr:`~kvtc.codec.container.Header.spans`): tokens before ``first`` are
not held and not stored; ``sinks`` held tokens from ``first`` and the ``window`` newest are stored raw; the
``middle`` ones between are coded by the span's PCA groups.

The raw sections (``raw.keys`` / ``raw.values``) hold, span after span, ``[batch, sinks + window, span layers,
heads, head_dim]``; with one span this is the whole-layout ``[batch, sinks + window, layers, heads, head_dim]`` that
version-1 blobs hold.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layout import DTYPES, PCAGrouping
from .header import Header


def _layers(t: torch.Tensor, indices: tuple[int, ...], every: int) -> torch.Tensor:
    """``t[:, :, indices]`` (a view when ``indices`` are all the layers)."""
    if len(indices) == every:
        return t
    return t.index_select(2, torch.tensor(indices, device=t.device))


def protected(t: torch.Tensor, header: Header) -> torch.Tensor:
    """The raw tokens of ``t [B, T, L, H, D]`` as one tensor: ``[B, s+w, L, H, D]`` with one span, else the
    spans' blocks flattened and concatenated."""
    T, L = header.tokens, len(header.layout.layers)
    blocks = []
    for sp, first, s, w, _ in header.spans:
        sub = _layers(t, sp.indices, L)
        blocks.append(torch.cat([sub[:, first : first + s], sub[:, T - w :]], dim=1))
    if len(blocks) == 1:
        return blocks[0]
    return torch.cat([b.reshape(-1) for b in blocks])


def raw_bytes(header: Header) -> int:
    """Bytes of one raw section (keys or values)."""
    lay = header.layout
    esize = torch.empty((), dtype=DTYPES[lay.dtype]).element_size()
    per = len(lay.heads) * lay.head_dim * esize
    return sum(header.batch * (s + w) * len(sp.indices) * per for sp, _, s, w, _ in header.spans)


def raw_blocks(flat: torch.Tensor, header: Header) -> list[torch.Tensor]:
    """A decoded raw section (flat) -> one ``[B, s+w, span layers, H, D]`` per span (one span: every layer, as a model
    whose layers are all sliding-window layers holds them)."""
    lay = header.layout
    out, off = [], 0
    for sp, _, s, w, _ in header.spans:
        shape = (header.batch, s + w, len(sp.indices), len(lay.heads), lay.head_dim)
        n = header.batch * (s + w) * len(sp.indices) * len(lay.heads) * lay.head_dim
        out.append(flat[off : off + n].view(shape))
        off += n
    return out


def fill_protected(full: torch.Tensor, blocks: list[torch.Tensor], header: Header) -> None:
    """Write each span's raw block into ``full [B, T, L, H, D]``."""
    T, L = header.tokens, len(header.layout.layers)
    for (sp, first, s, w, _), prot in zip(header.spans, blocks):
        if len(sp.indices) == L:
            full[:, first : first + s] = prot[:, :s]
            full[:, T - w :] = prot[:, s:]
        else:
            idx = torch.tensor(sp.indices, device=full.device)
            full[:, first : first + s, idx] = prot[:, :s].to(full.device)
            full[:, T - w :, idx] = prot[:, s:].to(full.device)


def group_middles(header: Header, grouping: PCAGrouping) -> list[tuple[int, int]]:
    """``(start, middle)`` per PCA group: the token range ``[start, start + middle)`` its rows come from."""
    by_span = {sp: (first + s, m) for sp, first, s, _, m in header.spans}
    return [by_span[sp] for sp in grouping.span_of(header.layout)]


def middle_view(t: torch.Tensor, start: int, middle: int) -> torch.Tensor:
    """``t [B, T, L, H, D]``'s tokens ``[start, start + middle)`` as ``[B, middle, features]`` (a view)."""
    return t[:, start : start + middle].flatten(2)


def per_layer(header: Header) -> list[tuple[Any, int, int, int, int, int]]:
    """For each layer (position in ``layout.layers``): ``(span, index within the span's raw block, first, sinks,
    window, middle)``."""
    out: list[Any] = [None] * len(header.layout.layers)
    for sp, first, s, w, m in header.spans:
        for j, i in enumerate(sp.indices):
            out[i] = (sp, j, first, s, w, m)
    return out
