"""Reconstruct a query's leaf set from returned selections (independently of the oracle)."""

from __future__ import annotations

import numpy as np

from htree_jax.core.indexing import num_top_parents
from reference_numpy.htree_numpy import rope


def leaf_set(t, selected_for_query, config, seq_len):
    """Merged nodes of one `(b, t, h_kv)` given its selections (top layer first).

    Returns a list of `(layer, node, buffer_position, n)` for every merged candidate,
    rebuilt from SPEC 2.1 (candidates) and 2.4 (merged = candidates - selected).
    """
    r = config.compression_rate
    L = config.num_layers(seq_len)
    assert len(selected_for_query) == L - 1
    parents = np.arange(num_top_parents(t, r, L))
    leaves = []
    for depth, l in enumerate(reversed(range(L))):
        c_star = (t // r**l) % r
        n = (len(parents) - 1) * r + c_star + 1
        pos = np.arange(n)
        nodes = parents[pos // r] * r + pos % r
        if l > 0:
            sel = np.asarray(selected_for_query[depth])
            sel = sel[sel >= 0]
            assert np.all(np.diff(sel) > 0), "selected nodes must be ascending"
            assert set(sel.tolist()) <= set(nodes.tolist()), "selected nodes must be candidates"
            assert len(sel) == min(config.top_k, n)
            assert sel[-1] == t // r**l, "the rightmost node is always selected, and last"
            is_merged = ~np.isin(nodes, sel)
            parents = sel
        else:
            is_merged = np.ones(n, bool)
        leaves += [(l, int(j), int(p), n) for j, p in zip(nodes[is_merged], pos[is_merged])]
    return leaves


def softmax_over_leaves(q_group, k_layers, v_layers, leaves, config):
    """SPEC 3 'Equivalence': float64 softmax attention over a leaf set, `q_group [G, K]`."""
    alpha = config.score_scale(q_group.shape[-1])
    scores, values = [], []
    for l, j, p, n in leaves:
        qr = rope(q_group.astype(np.float64), np.array([n - 1]), config.rope_base)
        kr = rope(k_layers[l][j][None].astype(np.float64), np.array([p]), config.rope_base)
        scores.append(alpha * (qr @ kr.T)[:, 0])
        values.append(v_layers[l][j].astype(np.float64))
    s = np.stack(scores, axis=1)  # [G, leaves]
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w @ np.stack(values)) / w.sum(axis=1, keepdims=True)


def run_readme_snippet(heading: str, document: str = "README.md") -> dict:
    """Executes the first ```python block after `heading` in `document` (a path from the
    repository's root: the README, or a page of `docs/`); returns its scope."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / document).read_text()
    section = readme[readme.index(heading):]
    scope: dict = {}
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), scope)
    return scope


def assert_mostly_agrees(o, sel, o_ref, sel_ref, group: int, share: float = 0.99, tol: float = 2e-2):
    """GPU checks against the reference: every layer's parent lists equal on at least
    `share` of the `(b, t, h_kv)` (near-ties of the kernels' scores may flip), and the
    outputs of the queries whose lists all agree within `tol` (relative, Frobenius);
    `group` query heads per kv head."""
    agree = np.ones(np.asarray(sel[0]).shape[:3], bool)
    for a, b in zip(sel, sel_ref):
        same = np.all(np.asarray(a) == np.asarray(b), axis=-1)
        assert same.mean() >= share, same.mean()
        agree &= same
    rows = np.repeat(agree, group, axis=2)
    got, want = np.asarray(o, np.float32)[rows], np.asarray(o_ref, np.float32)[rows]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


def assert_gradients_close(got, want, names, rtol: float = 1e-5, atol_share: float = 2e-5):
    """Gradients `got` equal `want` (same shapes and dtypes) to `rtol` and an absolute
    tolerance of `atol_share` of the largest `|want|`: a key's gradient sums over every
    head and query that reads it, so float32 sums in another order differ by a share of
    its scale, not of each (possibly near-cancelled) element."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = float(np.max(np.abs(np.asarray(b))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol_share * scale, err_msg=name)
