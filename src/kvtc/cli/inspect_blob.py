"""``kvtc inspect``: what a .kvtc file holds (no calibration needed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import ratio_line, size


def add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what a .kvtc file holds (no calibration needed)")
    p.add_argument("file", type=Path)
    p.add_argument("--json", action="store_true", help="print every field as JSON")
    p.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from ..codec import Codec
    from ..errors import FormatError
    from ..fileio import read_blob

    blob = read_blob(args.file)
    try:
        info = Codec.inspect(blob)
    except FormatError as e:
        raise FormatError(f"{args.file}: {e}") from None
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    lay = info["layout"]
    print(f"{args.file}: kvtc {info['mode']} blob, {size(info['bytes'])}")
    print(
        f"  model {info['model_id'] or '?'}; {len(lay['layers'])} KV layers x {len(lay['heads'])} heads x "
        f"{lay['head_dim']} ({lay['dtype']})"
    )
    print(
        f"  batch {info['batch']} x {info['tokens']} tokens: {info['sinks']} sinks + {info['middle_tokens']} coded + "
        f"{info['window']} window"
    )
    if info["mode"] == "kvtc":
        print(f"  calibration {info['calibration'][:16]}, target {info['target_ratio']}x, packing {info['packing']}")
    print(f"  {ratio_line(info)}")
    for s in info["sections"]:
        print(f"    {s['name']:<22} {s['backend']:<6} {size(s['raw']):>10} -> {size(s['coded']):>10}")
    return 0
