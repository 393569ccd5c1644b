"""Token tree: a rollout's calls as one token trie, every shared prefix stored once. Pure.

Owns the tree form (``GET /captures/rollouts/<id>/tree``, ``readers.load_tree``) for
tree-attention trainers: instead of one sample per root-to-leaf path (``core.samples``), which
repeats every shared prefix, the paths are merged into a radix tree of *segments* (runs of
tokens without a branch). A token is shared between paths only where the token id, the loss
mask and the log prob bits all agree, so every path's arrays are exactly its sample's: a
token one path generated (mask 1) and another only read (mask 0) sits in two segments. Paths of
different chains merge too (the title call and the agent share the system prompt; a refused
link shares its history with the call it did not link to).

Arrays (``TokenTree.arrays``), over ``num_tokens`` tree tokens in segment order (parents
before children; siblings in the order of the samples that made them):

- ``input_ids`` uint32 ``[num_tokens]``; ``positions`` int32 ``[num_tokens]`` (the index in
  its path's sequence, for position ids); ``loss_mask`` uint8; ``log_probs`` float32 (0.0 off
  the mask, as in the samples);
- ``segment_offsets`` int64 ``[num_segments + 1]``: segment ``i`` is tokens
  ``[offsets[i], offsets[i+1])``; ``segment_parent`` int32 ``[num_segments]``: the parent
  segment, -1 for a root; a token attends to its own segment's earlier tokens and to all of
  its ancestors' tokens;
- ``leaf_segment`` int32 ``[num_leaves]``: the segment each path ends with (its last token is
  that segment's last), in ``leaves`` order;
- with routed experts: ``routed_experts`` ``[num_tokens, num_layers, top_k]`` (the samples'
  widest dtype) and ``routed_experts_mask`` uint8 ``[num_tokens]``; a shared token takes the
  row of the first path that holds one.

``leaves``: ``[{chain_id, leaf_call_id, call_ids, segment, num_tokens}]``, one per sample.
``num_path_tokens`` is what one sample per path holds in all; ``num_tokens`` what the tree does.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from capture_proxy.core.samples import ChainSample

TREE_FORMAT = "capture-proxy.tree.npz"
TREE_VERSION = 1


@dataclass
class _Node:
    parent: int
    start: int  # position of the first token in its path
    ids: np.ndarray
    mask: np.ndarray
    bits: np.ndarray  # log probs as uint32, so NaN matches the same NaN
    log_probs: np.ndarray
    experts: np.ndarray | None
    experts_mask: np.ndarray | None
    children: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def key(self, i: int = 0) -> tuple[int, int, int]:
        return (int(self.ids[i]), int(self.mask[i]), int(self.bits[i]))

    def cut(self, a: int, b: int | None = None) -> dict[str, Any]:
        s = slice(a, b)
        return {
            "ids": self.ids[s],
            "mask": self.mask[s],
            "bits": self.bits[s],
            "log_probs": self.log_probs[s],
            "experts": None if self.experts is None else self.experts[s],
            "experts_mask": None if self.experts_mask is None else self.experts_mask[s],
        }


@dataclass(frozen=True)
class TokenTree:
    """A rollout's token trie (see the module docstring)."""

    rollout_id: str
    arrays: dict[str, np.ndarray]
    leaves: list[dict[str, Any]]
    num_path_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.arrays["segment_parent"].shape[0])

    def path_indices(self, leaf: int) -> np.ndarray:
        """Tree token indices of path ``leaf`` (index into ``leaves``), root first: the
        arrays at them are that path's sample arrays."""
        offsets, parents = self.arrays["segment_offsets"], self.arrays["segment_parent"]
        segs = []
        seg = int(self.arrays["leaf_segment"][leaf])
        while seg >= 0:
            segs.append(seg)
            seg = int(parents[seg])
        parts = [np.arange(offsets[s], offsets[s + 1]) for s in reversed(segs)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _experts_layout(samples: list[ChainSample]) -> tuple[tuple[int, ...], np.dtype] | None:
    shapes = {s.arrays["routed_experts"].shape[1:] for s in samples if "routed_experts" in s.arrays}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples disagree on the routed experts' shape: {sorted(shapes)}")
    dtypes = [s.arrays["routed_experts"].dtype for s in samples if "routed_experts" in s.arrays]
    return shapes.pop(), np.result_type(*dtypes)


def _sequence(
    sample: ChainSample, layout: tuple[tuple[int, ...], np.dtype] | None
) -> dict[str, Any]:
    """A sample's arrays in the node form (``_Node`` fields), experts padded to ``layout``."""
    a = sample.arrays
    n = int(a["input_ids"].shape[0])
    log_probs = np.ascontiguousarray(a["log_probs"], np.float32)
    seq: dict[str, Any] = {
        "ids": np.ascontiguousarray(a["input_ids"], np.uint32),
        "mask": np.ascontiguousarray(a["loss_mask"], np.uint8),
        "bits": log_probs.view(np.uint32),
        "log_probs": log_probs,
        "experts": None,
        "experts_mask": None,
    }
    if layout is not None:
        shape, dtype = layout
        ex = a.get("routed_experts")
        seq["experts"] = np.zeros((n, *shape), dtype) if ex is None else ex.astype(dtype)
        em = a.get("routed_experts_mask")
        seq["experts_mask"] = np.zeros(n, np.uint8) if em is None else em.astype(np.uint8)
    return seq


class _Trie:
    """The radix tree while it is built: nodes, the roots by first token, each path's last
    node (``leaf_nodes``, in insertion order)."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.roots: dict[tuple[int, int, int], int] = {}
        self.leaf_nodes: list[int] = []

    def new_node(self, parent: int, start: int, **parts: Any) -> int:
        self.nodes.append(_Node(parent, start, **parts))
        return len(self.nodes) - 1

    def _split(self, c: int, k: int) -> None:
        """Node ``c`` keeps ``[:k]``; a new child takes ``[k:]`` and the children."""
        nodes, node = self.nodes, self.nodes[c]
        tail = self.new_node(c, node.start + k, **node.cut(k))
        nodes[tail].children = node.children
        for grandchild in node.children.values():
            nodes[grandchild].parent = tail
        for name, value in node.cut(0, k).items():
            setattr(node, name, value)
        node.children = {nodes[tail].key(): tail}
        # A path that ended at the node's end now ends at the tail's.
        self.leaf_nodes = [tail if x == c else x for x in self.leaf_nodes]

    def insert(self, seq: dict[str, Any]) -> None:
        """Merge one path (``_sequence``) into the tree and note its last node."""
        n = int(seq["ids"].shape[0])
        pos, parent = 0, -1
        while pos < n:
            children = self.roots if parent < 0 else self.nodes[parent].children
            key = (int(seq["ids"][pos]), int(seq["mask"][pos]), int(seq["bits"][pos]))
            c = children.get(key)
            if c is None:
                parent = self.new_node(parent, pos, **{k: _slice(v, pos) for k, v in seq.items()})
                children[key] = parent
                break
            node = self.nodes[c]
            length = int(node.ids.shape[0])
            m = min(length, n - pos)
            eq = (
                (node.ids[:m] == seq["ids"][pos : pos + m])
                & (node.mask[:m] == seq["mask"][pos : pos + m])
                & (node.bits[:m] == seq["bits"][pos : pos + m])
            )
            k = m if bool(eq.all()) else int(np.argmin(eq))
            _fill_experts(node, seq, pos, k)
            if k < length:
                self._split(c, k)
            pos += k
            parent = c
        self.leaf_nodes.append(parent)

    def preorder(self) -> list[int]:
        """Node indices, parents before children (preorder from the roots, insertion order)."""
        order: list[int] = []
        stack = list(reversed(self.roots.values()))
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(self.nodes[i].children.values()))
        return order

    def arrays(
        self, order: list[int], layout: tuple[tuple[int, ...], np.dtype] | None
    ) -> dict[str, np.ndarray]:
        """The tree's arrays (see the module docstring) over the segments in ``order``."""
        nodes = self.nodes
        index = {node: seg for seg, node in enumerate(order)}
        lengths = np.array([nodes[i].ids.shape[0] for i in order], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

        def cat(name: str, dtype: Any) -> np.ndarray:
            parts = [getattr(nodes[i], name) for i in order]
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        positions = [
            np.arange(nodes[i].start, nodes[i].start + nodes[i].ids.shape[0]) for i in order
        ]
        arrays: dict[str, np.ndarray] = {
            "input_ids": cat("ids", np.uint32),
            "positions": (
                np.concatenate(positions).astype(np.int32) if order else np.zeros(0, np.int32)
            ),
            "loss_mask": cat("mask", np.uint8),
            "log_probs": cat("log_probs", np.float32),
            "segment_offsets": offsets,
            "segment_parent": np.array(
                [index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order], np.int32
            ),
            "leaf_segment": np.array([index[i] for i in self.leaf_nodes], np.int32),
        }
        if layout is not None:
            shape, dtype = layout
            arrays["routed_experts"] = (
                np.concatenate([nodes[i].experts for i in order]).astype(dtype)  # type: ignore[misc]
                if order
                else np.zeros((0, *shape), dtype)
            )
            arrays["routed_experts_mask"] = cat("experts_mask", np.uint8)
        return arrays


def build_token_tree(rollout_id: str, samples: list[ChainSample]) -> TokenTree:
    """Merge ``samples`` (in the order given, e.g. ``chain_samples`` over the chains) into a
    token tree. Raises ValueError when samples disagree on the routed experts' shape."""
    layout = _experts_layout(samples)
    trie = _Trie()
    for sample in samples:
        trie.insert(_sequence(sample, layout))
    order = trie.preorder()
    index = {node: seg for seg, node in enumerate(order)}
    leaves = [
        {
            "chain_id": s.chain_id,
            "leaf_call_id": s.leaf_call_id,
            "call_ids": s.call_ids,
            "segment": index[leaf],
            "num_tokens": int(s.arrays["input_ids"].shape[0]),
        }
        for s, leaf in zip(samples, trie.leaf_nodes, strict=True)
    ]
    total = sum(int(s.arrays["input_ids"].shape[0]) for s in samples)
    return TokenTree(rollout_id, trie.arrays(order, layout), leaves, total)


def _slice(value: np.ndarray | None, start: int) -> np.ndarray | None:
    return None if value is None else value[start:]


def _fill_experts(node: _Node, seq: dict[str, Any], pos: int, k: int) -> None:
    """Where the node has no routed-experts row but the merging path has, take its row."""
    if node.experts_mask is None or k == 0:
        return
    theirs = seq["experts_mask"][pos : pos + k]
    missing = (node.experts_mask[:k] == 0) & (theirs == 1)
    if missing.any():
        node.experts = node.experts.copy()  # type: ignore[union-attr]
        node.experts_mask = node.experts_mask.copy()
        node.experts[:k][missing] = seq["experts"][pos : pos + k][missing]
        node.experts_mask[:k][missing] = 1


def write_tree(tree: TokenTree, out: IO[bytes], extra: dict[str, Any] | None = None) -> None:
    """A zip: ``manifest.json`` (``format``, ``version``, ``rollout_id``, ``num_tokens``,
    ``num_path_tokens``, ``num_segments``, ``leaves``, ``**extra``) and ``tree.npz``."""
    manifest = {
        "format": TREE_FORMAT,
        "version": TREE_VERSION,
        "rollout_id": tree.rollout_id,
        "num_tokens": tree.num_tokens,
        "num_path_tokens": tree.num_path_tokens,
        "num_segments": tree.num_segments,
        "leaves": tree.leaves,
        **(extra or {}),
    }
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **tree.arrays)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("tree.npz", buf.getvalue())
        zf.writestr("manifest.json", json.dumps(manifest, ensure_ascii=False))


def read_tree(source: IO[bytes]) -> TokenTree:
    """Read what ``write_tree`` wrote. Raises ValueError for another format or a newer
    version (zipfile.BadZipFile, KeyError for a zip without the members)."""
    with zipfile.ZipFile(source) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        if manifest.get("format") != TREE_FORMAT:
            raise ValueError(f"not a {TREE_FORMAT} archive")
        if int(manifest.get("version", 0)) > TREE_VERSION:
            raise ValueError(f"tree version {manifest['version']} is newer than this reader")
        with np.load(io.BytesIO(zf.read("tree.npz")), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    return TokenTree(
        manifest["rollout_id"], arrays, manifest["leaves"], int(manifest["num_path_tokens"])
    )
