"""The ``huff4k`` GPU coder: batched coding and decoding of uint8 device tensors with the Triton kernels of
:mod:`kvtc.kernels.triton_huffman` (format and CPU coder: :mod:`kvtc.coding.huffman`).

Encoding (:meth:`DeviceCoder.encode_device`): a per-block byte histogram kernel over all streams, the
per-stream sums read back (one small sync), :func:`~kvtc.coding.huffman.code_lengths_batch` and the tables on
the host (the CPU coder's function: both write byte-identical streams), each block's bits from its histogram,
the word counts read back (a second small sync) and their exclusive cumulative sum, then one encode launch for
every block of every stream. Decoding parses and validates every header on the host, copies the words through
pinned memory and decodes every block in one launch.

The coder exists where CUDA and Triton are available (:func:`device_coder`, which the entropy registry
:mod:`kvtc.coding.entropy` calls). torch and Triton are imported lazily.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from .buffers import Parts, Pinned, align
from .huffman import _U32, BLOCK, NAME, TABLE, _block_sizes, code_lengths_batch, encode_tables, pack_lengths, parse
from .huffman_codes import decode_tables

if TYPE_CHECKING:  # pragma: no cover
    import torch

_COPY_WORDS = 1 << 22  # words a staging copy job moves (16 MiB)


class DeviceCoder:
    """Batched ``huff4k`` coding of uint8 device tensors with the Triton kernels (one launch per batch)."""

    def __init__(self, device: Any):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from ..kernels import triton_huffman

        self.torch = torch
        self.k = triton_huffman
        self.device = torch.device(device)
        #: pinned staging and synchronization on CUDA; a CPU device runs the kernels under TRITON_INTERPRET=1
        self.cuda = self.device.type == "cuda"
        self.pool = ThreadPoolExecutor(8)
        #: seconds of the last call's steps (for benchmarks)
        self.last: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- encode
    def _sources(self, flat: list[torch.Tensor]) -> tuple[torch.Tensor, list[int], list[Any]]:
        """One uint8 base tensor and each stream's byte offset from it. Streams on 16-byte aligned addresses
        are read where they lie (the kernels take offsets across allocations: no copy); others are copied
        into one aligned scratch buffer. Returns the tensors to keep alive while the kernels run."""
        torch = self.torch
        ok = [t.numel() == 0 or (t.device == self.device and t.data_ptr() % 16 == 0) for t in flat]
        scratch = None
        pos, spos = [], 0
        for t, good in zip(flat, ok):
            pos.append(spos)
            if not good:
                spos += align(t.numel())
        if spos:
            scratch = torch.empty(spos, dtype=torch.uint8, device=self.device)
            for t, good, p in zip(flat, ok, pos):
                if not good:
                    scratch[p : p + t.numel()].copy_(t)
        cands = [t for t, good in zip(flat, ok) if good and t.numel()]
        base = cands[0] if cands else scratch
        if base is None:
            return torch.zeros(16, dtype=torch.uint8, device=self.device), [0] * len(flat), []
        b0 = base.data_ptr()
        starts = [
            (t.data_ptr() - b0 if good else scratch.data_ptr() + p - b0) if t.numel() else 0
            for t, good, p in zip(flat, ok, pos)
        ]
        return base, starts, [scratch, *flat]

    def encode_device(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Code every stream on the device; returns the host-side tables and the device words (no D2H of
        the payload): ``lengths`` [S, 256] uint8, ``words`` (numpy int64 per block), ``spans`` (first,
        end block of each stream), ``out`` (int32 device words, all streams back to back), ``wstart``
        (first word of each stream).

        Steps: per-block byte histograms (one kernel over all streams) summed per stream and read back
        (sync 1); code lengths and tables on the host (:func:`code_lengths`, the CPU encoder's function);
        each block's bits = its histogram times the lengths, word counts read back (sync 2) and their
        exclusive cumulative sum; then the encode kernel writes every block at its first word."""
        torch = self.torch
        dev = self.device
        t0 = time.perf_counter()
        flat = [t.contiguous().view(torch.uint8).reshape(-1) for t in tensors]
        sizes = [t.numel() for t in flat]
        nblk = [-(-n // BLOCK) for n in sizes]
        spans, nb = [], 0
        for c in nblk:
            spans.append((nb, nb + c))
            nb += c
        if nb == 0:
            lengths = np.zeros((len(flat), 256), dtype=np.uint8)
            return {
                "lengths": lengths,
                "words": np.zeros(0, np.int64),
                "spans": spans,
                "out": torch.zeros(0, dtype=torch.int32, device=dev),
                "wstart": [0] * len(flat),
            }
        base, starts, keep = self._sources(flat)
        # per-block arrays, built on the device from per-stream numbers: byte offset from base, byte count
        per = torch.tensor([starts, sizes, [a for a, _ in spans], nblk], dtype=torch.int64).to(dev, non_blocking=True)
        sid = torch.repeat_interleave(torch.arange(len(flat), device=dev), per[3], output_size=nb)
        local = torch.arange(nb, device=dev) - per[2][sid]
        d_src = per[0][sid] + BLOCK * local
        d_n = torch.clamp(per[1][sid] - BLOCK * local, max=BLOCK).to(torch.int32)
        d_tab = (sid * 256).to(torch.int32)
        bh = self.k.block_hist(base, d_src, d_n)  # [blocks, 256] int32
        zero = torch.zeros(256, dtype=torch.int64, device=dev)
        hist = torch.stack([bh[a:b].sum(0, dtype=torch.int64) if b > a else zero for a, b in spans])
        hist_h = hist.cpu().numpy()  # sync 1: the histograms
        t1 = time.perf_counter()
        lengths = code_lengths_batch(hist_h)
        etab = encode_tables(lengths).reshape(-1)
        t2 = time.perf_counter()
        d_len = torch.from_numpy(lengths.astype(np.int32).reshape(-1)).to(dev, non_blocking=True)
        d_etab = torch.from_numpy(etab).to(dev, non_blocking=True)
        bits = self.k.block_bits(bh, d_tab, d_len)
        words = (bits + 31) >> 5
        wo = torch.cumsum(words.to(torch.int64), 0)
        words_h = words.cpu().numpy().astype(np.int64)  # sync 2: the word counts
        total = int(words_h.sum())
        t3 = time.perf_counter()
        out = torch.empty(max(total, 1), dtype=torch.int32, device=dev)
        self.k.encode(base, d_src, d_n, d_tab, d_etab, wo - words.to(torch.int64), out)
        csum = np.concatenate(([0], np.cumsum(words_h)))
        wstart = [int(csum[a]) for a, _ in spans]
        self._sync()
        del keep
        t4 = time.perf_counter()
        self.last = {"hist_s": t1 - t0, "tables_s": t2 - t1, "bits_s": t3 - t2, "encode_s": t4 - t3}
        return {"lengths": lengths, "words": words_h, "spans": spans, "out": out, "wstart": wstart}

    def compress(self, tensors: list[torch.Tensor]) -> list[bytes]:
        """Code each uint8 device tensor; returns one ``huff4k`` stream per tensor (what cpu_compress writes)."""
        return [bytes(p) for p in self.encode(tensors)]

    def encode(self, tensors: list[torch.Tensor]) -> list[Parts]:
        """:meth:`compress` with each stream as :class:`~kvtc.coding.buffers.Parts`: its header bytes and its
        words as a view of one pinned host buffer (the container joins them: no per-stream copy)."""
        torch = self.torch
        enc = self.encode_device(tensors)
        t0 = time.perf_counter()
        total = int(enc["words"].sum())
        host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=self.cuda)
        if total:
            host.copy_(enc["out"][:total])
        h = host.numpy().view("<u4")
        t1 = time.perf_counter()
        out = []
        for i, head in enumerate(self.heads(enc)):
            ws = enc["wstart"][i]
            a, b = enc["spans"][i]
            out.append(Parts([head, h[ws : ws + int(enc["words"][a:b].sum())]]))
        self.last = {**self.last, "d2h_s": t1 - t0, "frame_s": time.perf_counter() - t1}
        return out

    @staticmethod
    def heads(enc: dict[str, Any]) -> list[bytes]:
        """Each coded stream's header bytes (code lengths, block count, words of each block): what precedes
        its words in the stream."""
        out = []
        for i, (a, b) in enumerate(enc["spans"]):
            counts = np.asarray(enc["words"][a:b], dtype="<u2")
            out.append(b"".join([pack_lengths(enc["lengths"][i]), _U32.pack(len(counts)), counts.tobytes()]))
        return out

    # ---- decode
    def stage(
        self,
        streams: list[bytes | memoryview],
        raw_lens: list[int],
        pinned: tuple[Any, list[int]] | None = None,
        stream: Any = None,
        blocks: list[tuple[int, int]] | None = None,
        parsed: list[Any] | None = None,
    ) -> dict[str, Any]:
        """Validate the streams' headers and copy their words to the device (through pinned memory).

        ``pinned``: ``(tensor, offsets)`` when the streams lie in a pinned uint8 host tensor at those byte
        offsets: each stream's words go to the device straight from there (no host staging). ``stream``: a CUDA
        stream that runs the copies, so that they overlap work queued on the current stream; nothing is then
        synchronized and :meth:`decode_device` waits for the copies on the device. Without it the copies are
        waited for here. ``blocks``: ``(first, end)`` blocks of each stream to stage (all by default): a stream
        can be decoded in parts, each part's :meth:`decode_device` writing its blocks into one output buffer.
        ``parsed``: the streams' headers as an earlier call returned them (``st["parsed"]``)."""
        torch = self.torch
        dev = self.device
        t0 = time.perf_counter()
        parsed = parsed if parsed is not None else [parse(s, n) for s, n in zip(streams, raw_lens)]
        rng = blocks if blocks is not None else [(0, len(p.words)) for p in parsed]
        if len(rng) != len(parsed) or any(not 0 <= a <= b <= len(p.words) for (a, b), p in zip(rng, parsed)):
            raise ValueError("blocks: one (first, end) range of blocks per stream, within its blocks")
        side = stream if (stream is not None and self.cuda) else None
        main = torch.cuda.current_stream(dev) if side is not None else None
        ctx = torch.cuda.stream(side) if side is not None else _Null()
        with ctx:
            st = self._copy(streams, raw_lens, pinned, parsed, rng)
        t1 = time.perf_counter()
        if side is not None:
            ev = torch.cuda.Event()
            ev.record(side)
            st["ready"] = ev
            for t in st.values():  # made on the copy stream, used on the current one
                if isinstance(t, torch.Tensor):
                    t.record_stream(main)
        else:
            self._sync()
        self.last = {"parse_stage_s": st.pop("t_parse") - t0, "h2d_s": time.perf_counter() - t1}
        st["parsed"] = parsed
        return st

    def _copy(
        self,
        streams: list[bytes | memoryview],
        raw_lens: list[int],
        pinned: tuple[Any, list[int]] | None,
        parsed: list[Any],
        rng: list[tuple[int, int]],
    ) -> dict[str, Any]:
        """The copies of :meth:`stage` (blocks ``rng`` of each stream), queued on the current stream."""
        torch = self.torch
        dev = self.device
        cum = [np.concatenate(([0], np.cumsum(p.words))) for p in parsed]  # each block's first word
        nwords = [int(c[b] - c[a]) for c, (a, b) in zip(cum, rng)]
        wbase, w = [], 0
        for k in nwords:
            wbase.append(w)
            w += k
        obase, out_bytes = [], 0
        for n in raw_lens:  # every stream's output starts 16-byte aligned (the kernel stores 8 bytes at a time)
            obase.append(out_bytes)
            out_bytes += align(n)
        staging = d_words = None
        if pinned is not None:  # each stream's words straight from the pinned blob to their aligned place
            src_t, offs = pinned
            d_words = torch.empty(max(w, 1), dtype=torch.int32, device=dev)
            d_bytes = d_words.view(torch.uint8)
            for o, p, c, (a, _), wb, k in zip(offs, parsed, cum, rng, wbase, nwords):
                if k:
                    src = o + p.head + 4 * int(c[a])
                    d_bytes[4 * wb : 4 * (wb + k)].copy_(src_t[src : src + 4 * k], non_blocking=True)
        else:
            staging = torch.empty(max(w, 1), dtype=torch.int32, pin_memory=self.cuda)
            buf = staging.numpy()
            jobs = []
            for s, p, c, (a, _), wb, k in zip(streams, parsed, cum, rng, wbase, nwords):
                src = np.frombuffer(memoryview(s).cast("B")[p.head :], dtype="<i4")[int(c[a]) : int(c[a]) + k]
                for j in range(0, k, _COPY_WORDS):
                    jobs.append((buf[wb + j : wb + min(k, j + _COPY_WORDS)], src[j : j + _COPY_WORDS]))
            list(self.pool.map(lambda j: j[0].__setitem__(slice(None), j[1]), jobs))  # numpy copies drop the GIL
        dtab = (
            decode_tables(np.stack([p.lengths for p in parsed])).astype(np.int16).reshape(-1)
            if parsed
            else np.zeros(0, np.int16)
        )
        none = [np.zeros(0, np.int64)]
        parts = [(i, p, c, a, b) for i, (p, c, (a, b)) in enumerate(zip(parsed, cum, rng)) if b > a]
        blk_wo = np.concatenate([wbase[i] + c[a:b] - c[a] for i, p, c, a, b in parts] + none)
        blk_nw = np.concatenate([p.words[a:b] for i, p, c, a, b in parts] + none)
        blk_n = np.concatenate([_block_sizes(raw_lens[i])[a:b] for i, p, c, a, b in parts] + none)
        blk_out = np.concatenate([obase[i] + BLOCK * np.arange(a, b, dtype=np.int64) for i, p, c, a, b in parts] + none)
        blk_tab = np.concatenate([np.full(b - a, TABLE * i, dtype=np.int64) for i, p, c, a, b in parts] + none)
        nb = len(blk_n)
        t_parse = time.perf_counter()
        meta = torch.empty(max(5 * nb, 1), dtype=torch.int64, pin_memory=self.cuda)  # written in place: no copy
        np.concatenate([blk_wo, blk_out, blk_nw, blk_n, blk_tab], out=meta.numpy()[: 5 * nb], casting="unsafe")
        d_meta = meta.to(dev, non_blocking=True)
        if d_words is None:
            d_words = staging.to(dev, non_blocking=True)
        tab = torch.from_numpy(dtab if len(dtab) else np.zeros(1, np.int16))
        d_tab = (tab.pin_memory() if self.cuda else tab).to(dev, non_blocking=True)
        return {
            "t_parse": t_parse,
            "meta": d_meta,
            "nb": nb,
            "words": d_words,
            "tab": d_tab,
            "raw_lens": list(raw_lens),
            "obase": obase,
            "out_bytes": out_bytes,
            "blk_wo": d_meta[:nb],
            "blk_out": d_meta[nb : 2 * nb],
            "blk_nw": d_meta[2 * nb : 3 * nb].to(torch.int32),
            "blk_n": d_meta[3 * nb : 4 * nb].to(torch.int32),
            "blk_tab": d_meta[4 * nb : 5 * nb].to(torch.int32),
        }

    def decode_device(
        self, st: dict[str, Any], err: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Decode staged streams on the device; raises FormatError when any block is corrupt. ``err``: an int32
        device flag the kernel raises instead, checked by the caller (:meth:`check`) before anything decoded is
        used for more than device work (the kernel writes only inside each stream's output, corrupt or not):
        nothing is then synchronized here. ``out``: the uint8 buffer to decode into (``st["out_bytes"]`` bytes
        at least; a part staged with ``blocks`` writes its blocks into the buffer of an earlier part), returned
        as each stream's view."""
        torch = self.torch
        if "ready" in st:
            torch.cuda.current_stream(self.device).wait_event(st["ready"])
        if out is None:
            out = torch.empty(max(st["out_bytes"], 16), dtype=torch.uint8, device=self.device)
        elif out.dtype != torch.uint8 or out.numel() < st["out_bytes"] or out.device != self.device:
            raise ValueError(f"out: a uint8 buffer of {st['out_bytes']} bytes on {self.device} is needed")
        if st["nb"]:
            flag = err if err is not None else torch.zeros(1, dtype=torch.int32, device=self.device)
            self.k.decode(
                st["words"], st["blk_wo"], st["blk_nw"], st["blk_n"], st["blk_tab"], st["blk_out"], st["tab"], out, flag
            )
            if err is None:
                self.check(flag)  # the one sync of a decode
        return [out[o : o + n] for o, n in zip(st["obase"], st["raw_lens"])]

    @staticmethod
    def check(err: torch.Tensor) -> None:
        """Raise FormatError when the decode kernel flagged a corrupt block in ``err`` (synchronizes)."""
        if int(err.item()):
            raise FormatError(
                f"{NAME}: a block is corrupt (a code not in the table, not exactly its byte "
                "count within exactly its words, or nonzero padding)"
            )

    def decode(self, streams: list[bytes | memoryview], raw_lens: list[int], pinned: Pinned | None = None) -> list[Any]:
        """Decode ``huff4k`` streams into uint8 device tensors of exactly ``raw_lens`` bytes. ``pinned``:
        ``(tensor, offsets)`` when the streams lie in a pinned uint8 host tensor at those byte offsets
        (:meth:`stage` copies them from there)."""
        st = self.stage(streams, raw_lens, pinned=None if pinned is None else (pinned[0], list(pinned[1])))
        t0 = time.perf_counter()
        res = self.decode_device(st)
        self.last = {**self.last, "gpu_decode_s": time.perf_counter() - t0}
        return res

    def decompress(self, streams: list[bytes | memoryview], raw_lens: list[int]) -> list[torch.Tensor]:
        """:meth:`decode` of streams in host memory."""
        return self.decode(streams, raw_lens)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def device_coder(device: torch.device) -> DeviceCoder | None:
    """A ``huff4k`` GPU coder on ``device`` (a CUDA device), or None where Triton does not import."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken Triton: no GPU coder
        return None
    return DeviceCoder(device)


__all__ = ["DeviceCoder", "device_coder"]
