"""``kvtc inspect``: what a .kvtc file holds (no calibration needed).

It reads only what it shows: the prefix and the header (at most :data:`~kvtc.codec.container.MAX_HEADER_BYTES`
bytes), and the file's size from the file system, which must be what the header accounts for (a truncated file, or
one with bytes after its last section, is refused as ``read_blob`` refuses it). The sections themselves are read
only with ``--verify``, which streams them in bounded chunks to check their CRC-32s. Every string the header holds
(model id, calibration hash, section and backend names) is printed escaped (:func:`kvtc.textsafe.printable`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import zlib
from pathlib import Path
from typing import Any

from ..textsafe import printable
from .common import ratio_line, size

#: bytes read at a time when ``--verify`` checks the sections' checksums
VERIFY_CHUNK = 4 << 20


def add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what a .kvtc file holds (no calibration needed)",
        description="Show a .kvtc file's header and sizes. Reads the header only (and the file's size); "
        "--verify also reads every section to check its checksum.",
    )
    p.add_argument("file", type=Path)
    p.add_argument("--json", action="store_true", help="print every field as JSON")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also read every section (in bounded chunks) and check its CRC-32; a mismatch is an error",
    )
    p.set_defaults(run=run_inspect)


def inspect_file(path: Path, verify: bool = False) -> dict[str, Any]:
    """:meth:`Codec.inspect <kvtc.codec.Codec.inspect>` of the .kvtc file at ``path``, reading only its prefix and
    header: the file is mapped, not read, so the sections' pages are never touched. ``verify``: also stream every
    section through its CRC-32 (``info["verified"]`` then counts them); a mismatch raises
    :class:`~kvtc.errors.FormatError`."""
    from ..codec import Codec, container
    from ..errors import FormatError
    from ..fileio import _open_regular

    with _open_regular(path, "a .kvtc file", FormatError) as (f, nbytes):
        head = f.read(container.PREFIX.size)
        if len(head) == container.PREFIX.size:
            hlen = container.PREFIX.unpack(head)[3]
            if hlen <= container.MAX_HEADER_BYTES:
                head += f.read(hlen)
        try:
            header, body = container.read_header(head, partial=True)
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None
        need = body + sum(s.coded for s in header.sections)
        if need > nbytes:
            raise FormatError(
                f"{path}: truncated: its header accounts for {need} bytes, the file holds {nbytes} "
                f"({need - nbytes} missing)"
            )
        if need < nbytes:
            raise FormatError(
                f"{path}: {nbytes - need} trailing bytes after its last section (its header accounts for {need} "
                f"bytes, the file holds {nbytes}); the file is corrupt or extended"
            )
        try:
            mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
        except (OSError, ValueError, OverflowError, MemoryError) as e:
            raise FormatError(f"cannot map {path} to read its header ({e}); is it on a local file system?") from None
        try:
            info = Codec.inspect(mapped)  # touches the header's pages only: it takes the sections' sizes as declared
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None
        finally:
            with contextlib.suppress(BufferError):  # a view still held by a traceback: unmapped when freed
                mapped.close()
        if verify:
            f.seek(body)
            for s in header.sections:
                crc, left = 0, s.coded
                while left:
                    chunk = f.read(min(VERIFY_CHUNK, left))
                    if not chunk:
                        raise FormatError(f"{path} changed size while being read; read it again")
                    crc = zlib.crc32(chunk, crc)
                    left -= len(chunk)
                if crc != s.crc32:
                    raise FormatError(
                        f"{path}: section {printable(s.name, 64)}: checksum mismatch; the file is corrupt"
                    )
            info["verified"] = len(header.sections)
    return info


def run_inspect(args: argparse.Namespace) -> int:
    info = inspect_file(args.file, args.verify)
    if args.json:
        print(json.dumps(info, indent=2))  # ensure_ascii: every control, non-ASCII and lone surrogate is escaped
        return 0
    p = printable
    lay = info["layout"]
    print(f"{p(args.file, None)}: kvtc {p(info['mode'])} blob, {size(info['bytes'])}")
    print(
        f"  model {p(info['model_id']) or '?'}; {len(lay['layers'])} KV layers x {len(lay['heads'])} heads x "
        f"{p(lay['head_dim'])} ({p(lay['dtype'])})"
    )
    print(
        f"  batch {info['batch']} x {info['tokens']} tokens: {info['sinks']} sinks + {info['middle_tokens']} coded + "
        f"{info['window']} window"
    )
    if info["mode"] == "kvtc":
        print(
            f"  calibration {p(str(info['calibration'])[:16])}, target {p(info['target_ratio'], 32)}x, "
            f"packing {p(info['packing'])}"
        )
    print(f"  {ratio_line(info)}")
    for s in info["sections"]:
        print(f"    {p(s['name'], 64):<22} {p(s['backend'], 32):<6} {size(s['raw']):>10} -> {size(s['coded']):>10}")
    if "verified" in info:
        print(f"  checksums: all {info['verified']} sections match")
    return 0
