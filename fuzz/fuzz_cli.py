"""Malformed ``kvtc`` command lines, run in this process through ``kvtc.cli.main(argv)``.

Every invocation is one the CLI must refuse *before* loading a model: bad files (missing, a directory, a
FIFO, /dev/zero, empty, random bytes, a truncated blob, invalid UTF-8), malformed token records beside a
blob for ``generate --resume`` (1-D, ragged, strings, floats, out-of-range ids, empty, wrong format or
checksum, a batch or length the blob does not hold), bad numbers (``--max-new-tokens 0``, negative, ``abc``,
huge; ratios that are 0, negative, NaN or infinite), empty prompts, bad calibration files, ``--out`` into a
missing directory, unknown subcommands and options. And valid blobs that hold hostile strings (terminal escape
sequences, carriage returns, bidi controls, lone surrogates, C1 controls in the model id, calibration hash, section
and backend names), which ``inspect`` must show escaped (exit 0, or one refusal line), and a sparse blob whose header
declares one section of hundreds of MB, which ``inspect`` must answer without reading it.

Properties per invocation: exit code 2 (0 for the valid hostile and sparse blobs); stderr exactly one line (of a
refusal) and no traceback; nothing printed a terminal would act on (``unescaped_output``: a control character
other than newline, a format character or a lone surrogate on stdout or stderr); ``inspect`` of the sparse blob
reads under :data:`MAX_INSPECT_READ` bytes (``read_body``); no model loaded (a guard
replaces ``kvtc.assets.load_model`` and the default-calibration builder during the campaign, and reaching it
counts as the violation ``reached_model``); return within ``HANG_S`` (a call blocked on a FIFO is unblocked
and counted as a hang); nothing written outside the invocation's temp dir.

    python fuzz/fuzz_cli.py --runs 500 --seed 1 --out cli.json
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import Hung, Tally, call_with_timeout, campaign_args, write_summary  # noqa: E402

HANG_S = 20.0
TIME_LIMIT_S = HANG_S
FIXTURES = ROOT / "tests" / "fixtures"
TOKENS_SUFFIX = ".tokens.json"
#: the most ``inspect`` may read of a blob whose body is a hole (its header is at most 1 MiB)
MAX_INSPECT_READ = 16 << 20
#: cases where a valid blob is expected: exit 0 (or a one-line refusal), output escaped
EXPECT_OK = ("hostile_model_id", "hostile_calibration", "hostile_section_name", "hostile_backend", "sparse_huge")
#: strings a blob's header may carry to attack a terminal: clear the screen, retitle the window, rewrite the line,
#: reverse the text, a C1 CSI, zero-width and tag characters, lone surrogates (JSON "\ud800"), NUL, DEL
NASTY = [
    "\x1b[2J",
    "\x1b]0;pwned\x07",
    "\x1b[31mred\x1b[0m",
    "ok\rEVIL",
    "abc\u202edef",
    "\u2066x\u2069",
    "\x9b31m",
    "\u200b\u200d\ufeff",
    "\U000e0041",
    "\ud800",
    "\udcff",
    "a\udbff\udfffb",
    "\x00\x7f\x85",
    "\u2028\u2029",
    "\ue000\uffff",
    "\\x1b",
]
#: code points a random hostile string is drawn from: C0, DEL and C1 controls, bidi and zero-width format
#: characters, surrogates, private use, noncharacters, tags, and plain text
_RANGES = [(0, 0x1F), (0x7F, 0x9F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2066, 0x2069), (0xD800, 0xDFFF),
           (0xE000, 0xE00F), (0xFFF9, 0xFFFF), (0xE0000, 0xE007F), (0x20, 0x7E), (0xE0, 0x17F), (0x4E00, 0x4E10)]  # fmt: skip


class ReachedModel(BaseException):
    """Raised by the guard in place of loading a model (a BaseException: the CLI's handlers do not catch it)."""


def _guard(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ReachedModel(f"{what} called with {args!r:.120}")

    return refuse


@contextlib.contextmanager
def model_guard() -> Any:
    """Replace every way the CLI loads a model or builds the default calibration; yields what was guarded."""
    import importlib

    patched: list[tuple[Any, str, Any]] = []
    for module, names in (
        ("kvtc.assets", ("load_model",)),
        ("kvtc.integrations.hf_calibrate", ("default_calibration", "calibrate_model")),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:  # transformers missing: the CLI cannot get that far either
            continue
        for name in names:
            if hasattr(mod, name):
                patched.append((mod, name, getattr(mod, name)))
                setattr(mod, name, _guard(f"{module}.{name}"))
    try:
        yield [f"{m.__name__}.{n}" for m, n, _ in patched]
    finally:
        for mod, name, old in patched:
            setattr(mod, name, old)


# ------------------------------------------------------------------------------------------ the sandbox
class Sandbox:
    """One invocation's temp dir with every kind of bad (and good) file the cases point at."""

    def __init__(self, root: Path, blobs: dict[str, bytes], rng: random.Random) -> None:
        self.root = root
        root.mkdir()
        self.rng = rng
        self.kvtc_blob = blobs["kvtc"]
        self.identity_blob = blobs["identity"]
        w = self.write
        self.files = {
            "kvtc": w("sample.kvtc", self.kvtc_blob),
            "identity": w("identity.kvtc", self.identity_blob),
            "empty": w("empty.kvtc", b""),
            "random": w("random.kvtc", rng.randbytes(rng.choice((1, 17, 300, 5000)))),
            "truncated": w("truncated.kvtc", self.kvtc_blob[: rng.randrange(1, len(self.kvtc_blob))]),
            "magic_only": w("magic.kvtc", self.kvtc_blob[:16]),
            "text": w("text.kvtc", b"hello, this is not a blob\n"),
            "json": w("json.kvtc", b'{"format": "kvtc"}'),
        }
        (root / "dir.kvtc").mkdir()
        self.files["dir"] = root / "dir.kvtc"
        os.mkfifo(root / "fifo.kvtc")
        self.files["fifo"] = root / "fifo.kvtc"
        (root / "zero.kvtc").symlink_to("/dev/zero")
        self.files["zero"] = root / "zero.kvtc"
        (root / "dangling.kvtc").symlink_to(root / "nowhere" / "x")
        self.files["dangling"] = root / "dangling.kvtc"
        self.files["missing"] = root / "missing.kvtc"
        self.files["missing_dir"] = root / "no" / "such" / "dir" / "x.kvtc"
        self.bad_text = w("bad_utf8.txt", b"\xff\xfe\x00bad \xc3\x28 utf-8")
        self.calibration = w("cal.safetensors", (FIXTURES / "calibration.safetensors").read_bytes())
        self.bad_calibration = w("bad_cal.safetensors", rng.randbytes(200))

    def write(self, name: str, data: bytes) -> Path:
        p = self.root / name
        p.write_bytes(data)
        return p

    def bad_file(self, include_valid: bool = False) -> Path:
        kinds = [k for k in self.files if include_valid or k not in ("kvtc", "identity")]
        return self.files[self.rng.choice(kinds)]

    def unblock(self) -> None:
        """Give EOF to any reader blocked on a FIFO in the sandbox."""
        for p in self.root.rglob("*"):
            try:
                if p.is_fifo():
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


BAD_INTS = [
    "0",
    "-1",
    "-5",
    "abc",
    "",
    "1e3",
    "1.5",
    "nan",
    "99999999999999999999999",
    str(1 << 63),
    "0x10",
    " ",
    "--",
    "\u0663",
]
BAD_FLOATS = ["0", "-1", "-16", "nan", "inf", "-inf", "abc", "", "1e400", "1e-320", "0.5", "1", "0.999"]
BAD_TOKEN_IDS = [-1, -(1 << 63), 1 << 31, 1 << 63, 1 << 70, 10**12, 1.5, "7", None, True, [1], float("nan")]


def tokens_record(sb: Sandbox, blob: bytes, ids: Any, **over: Any) -> bytes:
    rec = {
        "format": "kvtc-tokens",
        "version": 1,
        "blob_sha256": hashlib.sha256(blob).hexdigest(),
        "chat": False,
        "token_ids": ids,
    }
    rec.update(over)
    return json.dumps(rec, allow_nan=True).encode()


def bad_tokens_case(rng: random.Random, sb: Sandbox) -> tuple[str, list[str]]:
    """generate --resume BLOB whose token record is malformed (the blob and calibration are fine)."""
    use_identity = rng.random() < 0.5
    blob_path = sb.files["identity" if use_identity else "kvtc"]
    blob = sb.identity_blob if use_identity else sb.kvtc_blob
    from kvtc.codec import Codec

    info = Codec.inspect(blob)
    batch, held = info["batch"], info["tokens"]
    good_row = [rng.randrange(1, 1000) for _ in range(max(held, 1) + 2)]
    kind = rng.choice(
        [
            "1d",
            "ragged",
            "strings",
            "floats",
            "out_of_range",
            "empty",
            "empty_rows",
            "deep",
            "dict",
            "wrong_sha",
            "wrong_format",
            "not_json",
            "json_list",
            "batch_mismatch",
            "too_short",
            "directory",
            "fifo",
            "huge_list",
            "nan",
        ]
    )
    rec_path = blob_path.with_name(blob_path.name + TOKENS_SUFFIX)
    rows = [list(good_row) for _ in range(batch)]
    if kind == "1d":
        data = tokens_record(sb, blob, good_row)
    elif kind == "ragged":
        data = tokens_record(
            sb, blob, [good_row, good_row[:-1]] if batch < 2 else [good_row] + [good_row[:-1]] * (batch - 1)
        )
    elif kind == "strings":
        data = tokens_record(sb, blob, [[str(t) for t in r] for r in rows])
    elif kind == "floats":
        data = tokens_record(sb, blob, [[t + 0.5 for t in r] for r in rows])
    elif kind == "out_of_range":
        bad = rng.choice(BAD_TOKEN_IDS)
        rows[0][rng.randrange(len(rows[0]))] = bad
        data = tokens_record(sb, blob, rows)
    elif kind == "empty":
        data = tokens_record(sb, blob, [])
    elif kind == "empty_rows":
        data = tokens_record(sb, blob, [[] for _ in range(batch)])
    elif kind == "deep":
        data = tokens_record(sb, blob, "@@").replace(b'"@@"', b"[" * 100_000 + b"]" * 100_000)
    elif kind == "dict":
        data = tokens_record(sb, blob, {"0": good_row})
    elif kind == "wrong_sha":
        data = tokens_record(sb, blob, rows, blob_sha256=rng.choice(["0" * 64, "", None, 5, "x" * 1000]))
    elif kind == "wrong_format":
        data = tokens_record(sb, blob, rows, format=rng.choice(["kvtc", None, 1, ""]))
    elif kind == "not_json":
        data = rng.choice([b"", b"{", b"\xff\xfe", b"[1, 2", b"NaN", b"null"])
    elif kind == "json_list":
        data = json.dumps(rows).encode()
    elif kind == "batch_mismatch":
        data = tokens_record(sb, blob, rows * 2 + [good_row])
    elif kind == "too_short":
        data = tokens_record(sb, blob, [r[: max(held - 1, 0)] for r in rows])
    elif kind == "huge_list":
        data = tokens_record(sb, blob, [[1] * 1_100_000])  # above the CLI's 2**20-token limit
    elif kind == "nan":
        data = tokens_record(sb, blob, [[float("nan")] * len(r) for r in rows])
    else:
        data = b""
    if kind == "directory":
        rec_path.mkdir()
    elif kind == "fifo":
        os.mkfifo(rec_path)
    else:
        rec_path.write_bytes(data)
    argv = ["generate", "--resume", str(blob_path), "--calibration", str(sb.calibration)]
    if rng.random() < 0.3:
        argv += ["--max-new-tokens", str(rng.choice((1, 4)))]
    return f"tokens_{kind}", argv


def hostile_text(rng: random.Random, most: int) -> str:
    """A string of at most ``most`` characters (at least 1) holding what a terminal would act on."""
    parts = [rng.choice(NASTY) for _ in range(rng.randrange(1, 4))]
    parts.append("".join(chr(rng.randint(*rng.choice(_RANGES))) for _ in range(rng.randrange(0, 12))))
    rng.shuffle(parts)
    return "".join(parts)[:most] or "\x1b"


def hostile_case(rng: random.Random, sb: Sandbox) -> tuple[str, list[str]]:
    """inspect of a valid blob (kvtc's own writer: canonical header, CRC recomputed) whose strings are hostile; a
    section with a hostile name and a wrong CRC under --verify; a header with a hostile mode or packing (refused);
    a sparse blob whose header declares one huge section (must not be read)."""
    import dataclasses

    from kvtc.codec import container
    from kvtc.codec.header import Section

    header, body = container.read_header(sb.kvtc_blob)
    sections = list(header.sections)
    kind = rng.choice([*EXPECT_OK, "hostile_bad_crc", "hostile_refused"])
    fields: dict[str, Any] = {}
    tail = sb.kvtc_blob[body:]
    if kind == "hostile_model_id":
        fields["model_id"] = hostile_text(rng, 4096)
    elif kind == "hostile_calibration":
        fields["calibration"] = hostile_text(rng, 128)
    elif kind in ("hostile_section_name", "hostile_bad_crc"):
        i = rng.randrange(len(sections))
        name = "\x1b" + hostile_text(rng, 63)
        crc = sections[i].crc32 ^ (1 if kind == "hostile_bad_crc" else 0)
        sections[i] = dataclasses.replace(sections[i], name=name, crc32=crc)
    elif kind == "hostile_backend":
        i = rng.choice([j for j, x in enumerate(sections) if x.coded < x.raw])  # a raw section must say "raw"
        sections[i] = dataclasses.replace(sections[i], backend="\x1b" + hostile_text(rng, 31))
    elif kind == "hostile_refused":
        fields[rng.choice(["mode", "packing"])] = hostile_text(rng, 40)
    elif kind == "sparse_huge":
        total = rng.choice((64 << 20, 256 << 20))
        fields.update(batch=16, tokens=1 << 20)
        sections, tail = [Section("keys.0.int2", "raw", total, total, 0)], b""
    head = container.prefix_and_header(dataclasses.replace(header, sections=sections, **fields))
    path = sb.write(f"{kind}.kvtc", head + tail)
    if kind == "sparse_huge":
        os.truncate(path, len(head) + sections[0].coded)
    extra = ["--verify"] if kind == "hostile_bad_crc" else rng.choice([[], [], ["--json"], ["--verify"]])
    return kind, ["inspect", str(path), *(extra if kind != "sparse_huge" else [])]


def unsafe_chars(text: str) -> list[str]:
    """What a terminal would act on in ``text``: controls but newline, format characters, lone surrogates."""
    import unicodedata

    return [ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Cs")]


def _read_bytes() -> int | None:
    """Bytes this process has read through read(2) and the like (Linux ``/proc/self/io`` rchar), or None."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def build_case(rng: random.Random, sb: Sandbox) -> tuple[str, list[str]]:
    if rng.random() < 0.15:
        return hostile_case(rng, sb)
    r = rng.random()
    f = sb.bad_file
    if r < 0.12:
        return "inspect_bad_file", ["inspect", str(f())] + (["--json"] if rng.random() < 0.3 else [])
    if r < 0.22:
        return "resume_bad_file", ["generate", "--resume", str(f()), "--calibration", str(sb.calibration)]
    if r < 0.42:
        return bad_tokens_case(rng, sb)
    if r < 0.5:
        cal = rng.choice([sb.bad_calibration, f(), sb.files["kvtc"]])
        return "resume_bad_calibration", ["generate", "--resume", str(sb.files["kvtc"]), "--calibration", str(cal)]
    if r < 0.58:
        v = rng.choice(BAD_INTS)
        base = rng.choice([["generate", "--prompt", "hello"], ["generate", "--resume", str(sb.files["identity"])]])
        return "max_new_tokens", base + ["--max-new-tokens", v]
    if r < 0.66:
        opt, v = rng.choice([("--ratio", rng.choice(BAD_FLOATS)), ("--max-tokens", rng.choice(BAD_INTS))])
        return "compress_numbers", ["compress", "--prompt", "hello world", "--out", str(sb.root / "o.kvtc"), opt, v]
    if r < 0.72:
        cmd = rng.choice([["compress", "--out", str(sb.root / "o.kvtc")], ["generate"]])
        return "empty_prompt", cmd + rng.choice(
            [
                ["--prompt", ""],
                ["--prompt", "   "],
                ["--file", str(sb.files["empty"])],
                ["--file", str(sb.bad_text)],
                ["--file", str(f())],
            ]
        )
    if r < 0.78:
        out = rng.choice([sb.files["missing_dir"], sb.files["dir"], sb.root / "sample.kvtc" / "x", sb.files["fifo"]])
        return "compress_out", ["compress", "--prompt", "hello world", "--out", str(out)] + (
            ["--identity"] if rng.random() < 0.5 else ["--calibration", str(sb.calibration)]
        )
    if r < 0.86:
        opt = rng.choice(
            [
                ("--tokens", rng.choice(BAD_INTS)),
                ("--ratios", rng.choice(BAD_FLOATS)),
                ("--window", rng.choice(BAD_INTS)),
                ("--value-weight", rng.choice(BAD_FLOATS)),
                ("--types", rng.choice(["bogus", "", ",", "int2,nope", "drop"])),
                ("--corpus", str(f())),
                ("--out", str(sb.files["missing_dir"])),
            ]
        )
        argv = (
            ["calibrate", *opt, "--out", str(sb.root / "c.safetensors")] if opt[0] != "--out" else ["calibrate", *opt]
        )
        return f"calibrate{opt[0].replace('--', '_')}", argv
    if r < 0.9:
        return "compress_calibration", [
            "compress",
            "--prompt",
            "hello world",
            "--out",
            str(sb.root / "o.kvtc"),
            "--calibration",
            str(rng.choice([sb.bad_calibration, f()])),
        ]
    return "usage", rng.choice(
        [
            [],
            ["frobnicate"],
            ["inspect"],
            ["inspect", "--bogus", str(sb.files["kvtc"])],
            ["generate", "--prompt", "a", "--file", str(sb.bad_text)],
            ["compress"],
            ["compress", "--prompt", "x"],
            ["--calibration"],
            ["inspect", str(f()), str(f())],
            ["\x00"],
            ["generate", "--resume"],
        ]
    )


# ------------------------------------------------------------------------------------------ one invocation
def _snapshot(dirs: list[Path]) -> dict[str, float]:
    out = {}
    for d in dirs:
        try:
            for e in os.scandir(d):
                out[e.path] = e.stat(follow_symlinks=False).st_mtime
        except OSError:
            pass
    return out


def run_one(
    argv: list[str], sb: Sandbox, watched: list[Path], name: str = ""
) -> tuple[str, float, tuple[str, str] | None, str]:
    """(outcome, seconds, violation or None, stderr) of ``kvtc.cli.main(argv)`` (``name``: the case's kind)."""
    from kvtc.cli import main

    expect_ok = name in EXPECT_OK
    before = _snapshot(watched)
    read0 = _read_bytes()
    out, err = io.StringIO(), io.StringIO()

    def call() -> int:
        try:
            return int(main(argv) or 0)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 2 if e.code else 0

    t0 = time.perf_counter()
    violation = None
    code: Any = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = call_with_timeout(call, HANG_S, sb.unblock)
            outcome = f"exit {code}"
        except Hung as e:
            outcome, violation = "hang", ("hang", str(e))
        except ReachedModel as e:
            outcome, violation = "reached_model", ("reached_model", f"a model would be loaded: {e}")
        except BaseException as e:  # noqa: BLE001 - the property under test
            outcome = type(e).__name__
            violation = (
                "exception",
                f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__)),
            )
    dt = time.perf_counter() - t0
    if dt >= HANG_S and violation is None:  # it returned only once a blocked read was given EOF
        outcome, violation = "hang", ("hang", f"blocked for {HANG_S:g} s (returned {code} once unblocked)")
    read = None if read0 is None else (_read_bytes() or 0) - read0
    stderr = err.getvalue()
    lines = stderr.splitlines()
    if violation is None:
        bad = unsafe_chars(out.getvalue() + stderr)
        if "Traceback (most recent call last)" in stderr:
            violation = ("traceback", stderr)
        elif "kvtc: internal error:" in stderr:  # the CLI's last-resort line for an untyped exception
            violation = ("untyped_exception", stderr)
        elif bad:
            violation = ("unescaped_output", f"{sorted(set(bad))[:8]!r} in stdout {out.getvalue()[-300:]!r}")
        elif code not in ((0, 2) if expect_ok else (2,)):
            violation = ("exit_code", f"exit code {code}; stderr {stderr[-500:]!r}; stdout {out.getvalue()[-300:]!r}")
        elif len(lines) != (0 if code == 0 else 1):
            violation = ("stderr_lines", f"{len(lines)} stderr lines: {stderr[-600:]!r}")
        elif name == "sparse_huge" and read is not None and read > MAX_INSPECT_READ:
            violation = ("read_body", f"inspect read {read} bytes of a blob whose body is a hole")
    after = _snapshot(watched)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed and violation is None:
        violation = ("wrote_outside", f"changed outside the temp dir: {changed[:5]}")
    if sb.files["missing_dir"].parent.exists() and violation is None:
        violation = ("wrote_outside", f"created {sb.files['missing_dir'].parent}")
    return outcome, dt, violation, stderr


def run(runs: int, seed: int) -> Tally:
    import corpus_seed
    from fuzz_container import _limit_memory

    seeds = corpus_seed.build_seeds()
    blobs = {"kvtc": (FIXTURES / "sample.kvtc").read_bytes(), "identity": seeds["identity_zstd_b3_t5"]}
    rng = random.Random(seed)
    tally = Tally("cli", seed)
    old_cwd, old_env = os.getcwd(), {k: os.environ.get(k) for k in ("HOME", "KVTC_CACHE", "HF_HUB_OFFLINE")}
    watched = [ROOT, Path(old_cwd)]  # (the cache and home dirs are moved into the temp dir for the campaign)
    import resource

    import kvtc.cli  # noqa: F401  (imported before the memory cap)

    limit = resource.getrlimit(resource.RLIMIT_AS)
    _limit_memory(1024)  # /dev/zero read to the end is a MemoryError (reported), not a swapped machine
    with tempfile.TemporaryDirectory(prefix="kvtc-fuzz-cli-") as d, model_guard() as guarded:
        tmp = Path(d)
        tally.extra["model_guard"] = guarded
        os.environ.update(HOME=str(tmp / "home"), KVTC_CACHE=str(tmp / "cache"), HF_HUB_OFFLINE="1")
        try:
            for i in range(runs):
                sb = Sandbox(tmp / f"case{i}", blobs, rng)
                os.chdir(sb.root)
                name, argv = build_case(rng, sb)
                outcome, dt, violation, stderr = run_one(argv, sb, watched, name)
                what = json.dumps([os.path.relpath(a, sb.root) if a.startswith(str(sb.root)) else a for a in argv])
                tally.add(
                    "cli", name, outcome, dt, what + (f" stderr: {stderr[-300:]!r}" if violation else ""), violation
                )
                os.chdir(tmp)
                sb.unblock()
                shutil.rmtree(sb.root, ignore_errors=True)
        finally:
            os.chdir(old_cwd)
            resource.setrlimit(resource.RLIMIT_AS, limit)
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return tally


TARGET = "kvtc.cli.main(argv) in-process: malformed files, token records, numbers, prompts, paths"


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = campaign_args(
        __doc__,
        300,
        argv,
        lambda ap: ap.add_argument("--hang-s", type=float, default=HANG_S, help="seconds an invocation may run"),
    )
    globals()["HANG_S"] = args.hang_s
    tally = run(args.runs, args.seed)
    print(write_summary(tally.summary(TARGET, args.hang_s, args.hang_s), args.out))
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
