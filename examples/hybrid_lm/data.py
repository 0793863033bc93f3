"""A small real text corpus, a byte-level tokenizer and a deterministic document packer.

`corpus.txt` is the opening ~200 KB of Sir Isaac Newton's *Opticks* (4th edition, 1730), a
public-domain work; the transcription is the one that ships with apache-tvm-ffi (a dependency
of the `gpu`/`test` extras) as `3rdparty/libbacktrace/Isaac.Newton-Opticks.txt`, with its
one-line producer credit dropped. Nothing is downloaded at run time.

Documents are the corpus's paragraphs (paragraphs shorter than `min_doc_bytes` are merged with
the next one, so headings travel with their text). Each document is tokenized as
``[BOS] + utf-8 bytes + [EOS]``.

The packer is stateless: the documents of epoch ``e`` are visited in a permutation drawn from
``seed + e`` and laid end to end in an infinite token stream; the batch of step ``s`` is the
slice ``[s * seq_len, (s + 1) * seq_len)`` of that stream. A document cut by a batch edge
continues as its own (BOS-less) document at the start of the next batch. So resuming at step
``s`` needs nothing but ``s``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["ByteTokenizer", "PackedBatch", "DocumentPacker", "load_corpus", "load_documents", "IGNORE_INDEX"]

IGNORE_INDEX = -100


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, then BOS and EOS."""

    BOS = 256
    EOS = 257
    vocab_size = 258

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids, self.EOS] if add_special else ids

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_corpus() -> str:
    """The shipped corpus as one string."""
    return (Path(__file__).parent / "corpus.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=4)
def _documents(min_doc_bytes: int) -> tuple[str, ...]:
    docs, pending = [], ""
    for para in load_corpus().split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        pending = f"{pending}\n\n{para}" if pending else para
        if len(pending.encode("utf-8")) >= min_doc_bytes:
            docs.append(pending)
            pending = ""
    if pending:
        docs.append(pending)
    return tuple(docs)


def load_documents(min_doc_bytes: int = 64) -> list[str]:
    """The corpus split into documents (paragraphs, short ones merged forward)."""
    return list(_documents(min_doc_bytes))


@dataclass
class PackedBatch:
    """One packed row of documents.

    input_ids: [T] int64 tokens. labels: [T] next token within the same document, IGNORE_INDEX
    at each document's last token. cu_seqlens: [N + 1] int32 document offsets (0 .. T).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def split(self, parts: int) -> list["PackedBatch"]:
        """Cut into `parts` equal contiguous rows; a document crossing a cut becomes two documents
        (its label across the cut is dropped). Used for the data-parallel split."""
        T = self.num_tokens
        if T % parts:
            raise ValueError(f"a batch of {T} tokens cannot be cut into {parts} equal parts")
        n = T // parts
        cu = self.cu_seqlens.tolist()
        out = []
        for p in range(parts):
            lo, hi = p * n, (p + 1) * n
            bounds = sorted({lo, hi, *[c for c in cu if lo < c < hi]})
            labels = self.labels[lo:hi].clone()
            labels[-1] = IGNORE_INDEX
            out.append(
                PackedBatch(
                    self.input_ids[lo:hi].clone(),
                    labels,
                    torch.tensor([b - lo for b in bounds], dtype=torch.int32),
                )
            )
        return out


def labels_from_cu_seqlens(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token labels of a packed row: the following token, IGNORE_INDEX at each document end."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = input_ids[1:]
    ends = cu_seqlens[1:].long() - 1
    labels[ends] = IGNORE_INDEX
    return labels


class DocumentPacker:
    """Deterministic, stateless packing of the corpus's documents into rows of `seq_len` tokens."""

    def __init__(self, seq_len: int, seed: int = 0, tokenizer: ByteTokenizer | None = None, min_doc_bytes: int = 64,
                 documents: list[str] | None = None):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.tokenizer = tokenizer or ByteTokenizer()
        docs = documents if documents is not None else load_documents(min_doc_bytes)
        self.docs = [torch.tensor(self.tokenizer.encode(d), dtype=torch.int64) for d in docs]
        self.lengths = [d.numel() for d in self.docs]
        self.epoch_tokens = sum(self.lengths)
        self._perm_cache: dict[int, tuple[list[int], list[int]]] = {}

    def _epoch(self, e: int):
        """(document order, cumulative start offsets) of epoch e."""
        if e not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
            order = torch.randperm(len(self.docs), generator=g).tolist()
            starts, c = [], 0
            for i in order:
                starts.append(c)
                c += self.lengths[i]
            if len(self._perm_cache) > 8:
                self._perm_cache.clear()
            self._perm_cache[e] = (order, starts)
        return self._perm_cache[e]

    def _stream(self, lo: int, hi: int):
        """Pieces (tokens, starts_a_document) covering stream positions [lo, hi)."""
        pieces, p = [], lo
        while p < hi:
            e, off = divmod(p, self.epoch_tokens)
            order, starts = self._epoch(e)
            j = bisect.bisect_right(starts, off) - 1
            doc = self.docs[order[j]]
            a = off - starts[j]
            b = min(doc.numel(), a + (hi - p))
            pieces.append((doc[a:b], a == 0))
            p += b - a
        return pieces

    def batch(self, step: int) -> PackedBatch:
        """The packed row of `seq_len` tokens for training step `step` (0-based)."""
        lo = step * self.seq_len
        pieces = self._stream(lo, lo + self.seq_len)
        ids = torch.cat([t for t, _ in pieces])
        cu = [0]
        for t, _ in pieces:
            cu.append(cu[-1] + t.numel())
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        return PackedBatch(ids, labels_from_cu_seqlens(ids, cu_seqlens), cu_seqlens)
