"""Training and held-out text for the mask trainer, all read from this machine (no download).

Sources (each one a "document" of natural long text; see the package docstring for why):
- code, `stdlib:<name>`: each package directory (or single module) of this Python's standard
  library, its `.py` files concatenated in sorted path order, each file preceded by a
  `# file: <relative path>` line: repository-level code. Left out: `test` (the CPython test
  suite, large and test cases rather than library code), `site-packages`, `idlelib`,
  `pydoc_data` (used as text) and `__pycache__`.
- code, `site:<name>`: the same for each top-level package of the running interpreter's
  site-packages (the project venv: torch, transformers, numpy, ...).
- text, `doc:python-topics`: the Python language reference topics behind `help()`
  (`pydoc_data/topics.py`), in sorted topic order.
- text, `doc:vim/<file>`: each of Vim's help files (`/usr/share/vim/vim*/doc/*.txt`) when Vim is
  installed: long technical English manuals.
- text, `book:<name>`: public-domain books that happen to ship inside installed packages; this
  machine has one, Isaac Newton's "Opticks" (Project Gutenberg text, 4th edition 1730), which
  libbacktrace's test data carries in the `tvm_ffi` package.
Files over MAX_FILE_BYTES (generated tables) and undecodable files are skipped; a source stops
after `max_source_chars` characters so that no package (torch) dominates.

Split, by source and deterministic: every book is held out (there is one; splitting it by
chapters would leak its style and vocabulary into training, and the evaluation wants natural
prose it never saw); any other source is held out iff sha256(name) mod 1000 < 1000 * fraction
(default 10 %). Names are stable across machines, so the split is too.

Packing, per split and kind: sources in a seeded random order (reshuffled for every pass over
the data), each tokenized without special tokens and followed by EOS, concatenated and cut
into sequences of exactly `seq_len` tokens (the remainder of the last pass is dropped). The
mixed stream draws each next sequence from the text stream with probability `text_share`,
else from the code stream, with a seeded generator. Everything is a pure function of (seed,
sources, tokenizer), so a resumed run rebuilds the same sequences and skips the used ones.

Passkey data (the DuoAttention baseline): a haystack from the text stream with `num_passkeys`
needle sentences ("The passkey number 3 is: lemon river ... .") at seeded random depths, then a
question and the answer reciting every passkey; the answer tokens close the sequence, exactly
`seq_len` tokens in all.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

Encode = Callable[[str], list[int]]

MAX_FILE_BYTES = 400_000
DEFAULT_MAX_SOURCE_CHARS = 1_000_000
DEFAULT_HELD_OUT_FRACTION = 0.1
DEFAULT_TEXT_SHARE = 0.5
KINDS = ("text", "code")
STDLIB_EXCLUDE = {"test", "site-packages", "idlelib", "pydoc_data", "__pycache__"}
# Public-domain books known to ship inside Python packages (file name -> source name).
KNOWN_BOOKS = {"Isaac.Newton-Opticks.txt": "book:Isaac.Newton-Opticks"}


@dataclass(frozen=True)
class Source:
    """One document: `files` read in order (code files get a path header), or `text` itself."""

    name: str
    kind: str  # "text" | "code"
    files: tuple[Path, ...] = ()
    root: Path | None = None  # code headers are paths relative to it
    text_value: str | None = None
    max_chars: int = DEFAULT_MAX_SOURCE_CHARS

    def pieces(self) -> Iterator[str]:
        """The document in pieces (one per file), at most `max_chars` characters in all."""
        budget = self.max_chars
        if self.text_value is not None:
            yield self.text_value[:budget]
            return
        for path in self.files:
            if budget <= 0:
                return
            try:
                if path.stat().st_size > MAX_FILE_BYTES:
                    continue
                body = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not body.strip():
                continue
            if self.kind == "code":
                rel = path.relative_to(self.root) if self.root else path.name
                body = f"# file: {rel}\n{body}\n"
            piece = body[:budget]
            budget -= len(piece)
            yield piece


def held_out(name: str, fraction: float = DEFAULT_HELD_OUT_FRACTION) -> bool:
    """Books always; anything else iff sha256(name) mod 1000 < 1000 * fraction."""
    if name.startswith("book:"):
        return True
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000
    return bucket < round(1000 * fraction)


def split_sources(sources: Sequence[Source], fraction: float = DEFAULT_HELD_OUT_FRACTION
                  ) -> tuple[list[Source], list[Source]]:
    """(train, held_out), each in input order."""
    train = [s for s in sources if not held_out(s.name, fraction)]
    test = [s for s in sources if held_out(s.name, fraction)]
    return train, test


# -- discovery ----------------------------------------------------------------------------------

def _py_files(path: Path) -> tuple[Path, ...]:
    if path.is_file():
        return (path,)
    return tuple(sorted(p for p in path.rglob("*.py")
                        if "__pycache__" not in p.parts and p.is_file()))


def _package_sources(root: Path, prefix: str, exclude: set[str],
                     max_chars: int) -> list[Source]:
    out = []
    if not root.is_dir():
        return out
    for child in sorted(root.iterdir()):
        name = child.name
        if name in exclude or name.startswith(".") or name.endswith((".dist-info", ".egg-info")):
            continue
        if child.is_dir():
            files = _py_files(child)
        elif name.endswith(".py"):
            files, name = (child,), name[: -len(".py")]
        else:
            continue
        if files:
            out.append(Source(f"{prefix}:{name}", "code", files, root, max_chars=max_chars))
    return out


def _topics_text(stdlib: Path) -> str | None:
    import ast

    path = stdlib / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return "\n\n".join(topics[key] for key in sorted(topics))
    return None


def _book_text(path: Path) -> str:
    """The book without Project Gutenberg's licence header and footer, when it has them."""
    text = path.read_text(encoding="utf-8", errors="replace")
    start = text.find("*** START OF")
    if start >= 0:
        text = text[text.find("\n", start) + 1:]
    end = text.find("*** END OF")
    if end >= 0:
        text = text[:end]
    return text


def discover_sources(max_source_chars: int = DEFAULT_MAX_SOURCE_CHARS,
                     stdlib: Path | None = None, site_packages: Path | None = None,
                     vim_doc_glob: str = "/usr/share/vim/vim*/doc") -> list[Source]:
    """Every source on this machine, sorted by name (see the module docstring)."""
    stdlib = Path(stdlib or sysconfig.get_path("stdlib"))
    site_packages = Path(site_packages or sysconfig.get_path("purelib"))
    sources = _package_sources(stdlib, "stdlib", STDLIB_EXCLUDE, max_source_chars)
    sources += _package_sources(site_packages, "site", {"__pycache__"}, max_source_chars)
    topics = _topics_text(stdlib)
    if topics:
        sources.append(Source("doc:python-topics", "text", text_value=topics,
                              max_chars=max_source_chars))
    for doc_dir in sorted(Path("/").glob(vim_doc_glob.lstrip("/"))) if vim_doc_glob else []:
        for path in sorted(doc_dir.glob("*.txt")):
            sources.append(Source(f"doc:vim/{path.name}", "text", (path,),
                                  max_chars=max_source_chars))
    for file_name, name in sorted(KNOWN_BOOKS.items()):
        found = sorted(site_packages.rglob(file_name))
        if found:
            sources.append(Source(name, "text", text_value=_book_text(found[0]),
                                  max_chars=max(max_source_chars, 10 ** 7)))
    return sorted(sources, key=lambda s: s.name)


def describe(sources: Sequence[Source]) -> dict:
    """Counts and names per kind, for the exported metadata."""
    out = {}
    for kind in KINDS:
        names = [s.name for s in sources if s.kind == kind]
        out[kind] = {"count": len(names), "names": names}
    return out


# -- packing ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedSequence:
    ids: tuple[int, ...]  # exactly seq_len tokens
    kind: str
    sources: tuple[str, ...]  # the sources it contains, in order


def _rng(seed: int, *tags: object) -> random.Random:
    return random.Random(":".join(map(str, (seed, *tags))))


def pack_kind(sources: Sequence[Source], encode: Encode, eos_id: int, seq_len: int,
              seed: int, tag: str = "", max_passes: int | None = None
              ) -> Iterator[PackedSequence]:
    """Sequences of exactly seq_len tokens from `sources` (one kind), pass after pass, each
    pass in a new seeded order; stops after `max_passes` (None: never) or if a whole pass
    cannot fill one sequence."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    kind = sources[0].kind if sources else ""
    epoch = 0
    while max_passes is None or epoch < max_passes:
        order = list(sources)
        _rng(seed, tag, kind, epoch).shuffle(order)
        buffer: list[int] = []
        names: list[str] = []
        produced = 0
        for source in order:
            names.append(source.name)
            for piece in source.pieces():
                buffer.extend(encode(piece))
                while len(buffer) >= seq_len:
                    yield PackedSequence(tuple(buffer[:seq_len]), kind, tuple(names))
                    produced += 1
                    buffer = buffer[seq_len:]
                    names = [source.name]
            buffer.append(eos_id)
        if produced == 0:
            return
        epoch += 1


def mixed_stream(sources: Sequence[Source], encode: Encode, eos_id: int, seq_len: int,
                 seed: int, text_share: float = DEFAULT_TEXT_SHARE, tag: str = "",
                 max_passes: int | None = None) -> Iterator[PackedSequence]:
    """Sequences drawn from the text stream with probability text_share, else from code."""
    streams = {kind: pack_kind([s for s in sources if s.kind == kind], encode, eos_id, seq_len,
                               seed, tag, max_passes) for kind in KINDS}
    live = {kind for kind in KINDS if any(s.kind == kind for s in sources)}
    choose = _rng(seed, tag, "mix")
    while live:
        if live == set(KINDS):
            kind = "text" if choose.random() < text_share else "code"
        else:
            kind = next(iter(live))
        try:
            yield next(streams[kind])
        except StopIteration:
            live.discard(kind)


def take(stream: Iterator[PackedSequence], count: int) -> list[PackedSequence]:
    out = []
    for seq in stream:
        if len(out) == count:
            break
        out.append(seq)
    if len(out) < count:
        raise ValueError(f"the sources give only {len(out)} sequences, {count} requested")
    return out


# -- passkey retrieval (DuoAttention's synthetic data) -----------------------------------------

PASSKEY_WORDS = (
    "apple", "river", "candle", "marble", "falcon", "violet", "harbor", "copper", "meadow",
    "lantern", "pepper", "glacier", "orchid", "thunder", "velvet", "compass", "saddle",
    "walnut", "ember", "lemon", "quartz", "willow", "pebble", "anchor", "cobalt", "maple",
    "raven", "summit", "tulip", "bramble", "cinder", "dagger", "fossil", "garnet", "hollow",
    "ivory", "jasmine", "kettle", "lagoon", "mosaic", "nectar", "oyster", "prism", "quiver",
    "ribbon", "spruce", "timber", "umber", "vortex", "wicker", "yonder", "zephyr", "basil",
    "crimson", "dune", "echo", "feather", "ginger", "hazel", "indigo", "juniper", "kelp",
    "linen", "mango")


@dataclass(frozen=True)
class PasskeySequence:
    ids: tuple[int, ...]  # exactly seq_len tokens
    answer_len: int  # the last answer_len tokens are the recited passkeys
    passkeys: tuple[str, ...]
    depths: tuple[float, ...]  # relative position of each needle in the haystack


def passkey_sequence(haystack: Sequence[int], encode: Encode, seq_len: int, seed: int,
                     index: int, num_passkeys: int = 10, words: int = 8) -> PasskeySequence:
    """Needles at seeded random depths of `haystack` (token ids, at least seq_len long), a
    question and the answer, exactly seq_len tokens (the haystack is cut to fit)."""
    rng = _rng(seed, "passkey", index)
    keys = tuple(" ".join(rng.choice(PASSKEY_WORDS) for _ in range(words))
                 for _ in range(num_passkeys))
    needles = [encode(f"\nThe passkey number {i + 1} is: {key}. Remember it.\n")
               for i, key in enumerate(keys)]
    question = encode("\nWhat are the passkeys? Recite every one of them.\n")
    answer = encode("".join(f"The passkey number {i + 1} is: {key}.\n"
                            for i, key in enumerate(keys)))
    filler = seq_len - sum(map(len, needles)) - len(question) - len(answer)
    if filler < 1:
        raise ValueError(f"seq_len {seq_len} is too short for {num_passkeys} passkeys of "
                         f"{words} words ({seq_len - filler + 1} tokens needed)")
    if len(haystack) < filler:
        raise ValueError(f"haystack has {len(haystack)} tokens, {filler} needed")
    cuts = sorted(rng.randrange(filler + 1) for _ in keys)
    ids: list[int] = []
    previous = 0
    for cut, needle in zip(cuts, needles):
        ids.extend(haystack[previous:cut])
        ids.extend(needle)
        previous = cut
    ids.extend(haystack[previous:filler])
    ids.extend(question)
    ids.extend(answer)
    assert len(ids) == seq_len
    return PasskeySequence(tuple(ids), len(answer), keys,
                           tuple(cut / filler for cut in cuts))
