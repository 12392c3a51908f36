"""Reference forward tests (docs/model.md): greedy output, held-out perplexity, dense == sparse
with every slot, the RoPE pairing, and the lightning indexer against direct loops.

Measured with the fp32 reference on the converted Q4_1 model: held-out Python-docs perplexity of
the first 1,024 tokens 3.058 (fp64: 3.058), bound 4.0; the first 512 tokens 6.17 with adjacent
RoPE pairs and 399 with the half-split pairing, bound ratio 5."""
import numpy as np
import pytest

from dsa_model.config import IndexerConfig, ModelFileError
from dsa_model.reference import (Reference, load_indexer_weights, random_indexer_weights, rope,
                                 topk_selection, write_indexer_weights)
from dsa_model.tokenizer import decode, encode

HELDOUT_PPL_BOUND = 4.0
ROPE_PAIRING_RATIO = 5.0


def all_slots(num_layers, n, seed=0):
    rng = np.random.default_rng(seed)
    sel = np.full((num_layers, n, n), -1, dtype=np.int32)
    for layer in range(num_layers):
        for t in range(n):
            sel[layer, t, :t + 1] = rng.permutation(t + 1)
    return sel


def test_greedy_paris(reference, tokenizer):
    out = reference.greedy(encode(tokenizer, "The capital of France is"), 4)
    assert decode(tokenizer, out).startswith(" Paris")


def test_heldout_perplexity(reference, heldout):
    ppl = reference.perplexity(heldout[:1024])
    assert 1.0 < ppl < HELDOUT_PPL_BOUND, ppl


def test_rope_pairing_matters(reference, heldout):
    swapped = Reference(reference.weights, reference.config, rope_pairing="half")
    right, wrong = reference.perplexity(heldout[:512]), swapped.perplexity(heldout[:512])
    assert wrong > ROPE_PAIRING_RATIO * right, (right, wrong)


def test_greedy_cache_equals_full_forward(reference, heldout):
    prompt = heldout[:40]
    out = reference.greedy(prompt, 3)
    full = reference.forward(np.concatenate([prompt, out[:2]]))
    assert [int(np.argmax(full[i])) for i in (-3, -2, -1)] == out


def test_dense_equals_sparse_with_every_slot(reference, heldout):
    tokens = heldout[100:196]
    dense = reference.forward(tokens)
    sel = all_slots(reference.config.num_layers, len(tokens))
    assert np.array_equal(reference.forward(tokens, sel), dense)
    assert np.array_equal(reference.forward(tokens, lambda layer, x: sel[layer]), dense)
    padded = np.concatenate([sel, np.full(sel.shape[:2] + (7,), -1, np.int32)], axis=2)
    assert np.array_equal(reference.forward(tokens, padded), dense)


def test_sparse_window_differs_from_dense(reference, heldout):
    tokens = heldout[:64]
    n = len(tokens)
    window = np.array([[t - j if t - j >= 0 else -1 for j in range(4)] for t in range(n)])
    sparse = reference.forward(tokens, [window] * reference.config.num_layers)
    dense = reference.forward(tokens)
    assert np.isfinite(sparse).all()
    np.testing.assert_array_equal(sparse[:4], dense[:4])
    assert np.abs(sparse[8:] - dense[8:]).max() > 1.0


def test_selection_errors(reference):
    tokens = np.arange(20, 28)
    sel = all_slots(reference.config.num_layers, 8)
    bad = sel.copy()
    bad[3, 2, 0] = 5
    with pytest.raises(ValueError, match=r"layer 3: row 2 selects slot 5, outside \[0, 2\]"):
        reference.forward(tokens, bad)
    bad = sel.copy()
    bad[0, 4, :2] = [1, 1]
    with pytest.raises(ValueError, match="layer 0: row 4 selects a slot twice"):
        reference.forward(tokens, bad)
    bad = sel.copy()
    bad[5, 6] = -1
    with pytest.raises(ValueError, match="layer 5: row 6 selects no slot"):
        reference.forward(tokens, bad)
    with pytest.raises(ValueError, match="selections has 2 layers, expected 30"):
        reference.forward(tokens, sel[:2])


def test_rope_is_a_complex_rotation():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 64))
    positions = np.array([0, 1, 7, 100, 8191])
    out = rope(x, positions, 100000.0, rope_dims=32)
    theta = 100000.0 ** (-np.arange(16) * 2 / 32)
    z = (x[..., 0:32:2] + 1j * x[..., 1:32:2]) * np.exp(1j * positions[:, None, None] * theta)
    np.testing.assert_allclose(out[..., 0:32:2], z.real, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out[..., 1:32:2], z.imag, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out[..., 32:], x[..., 32:])


def test_topk_selection_rules():
    scores = np.array([[1.0, 3.0, 3.0, -np.inf, np.nan, 2.0],
                       [0.0, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf]])
    np.testing.assert_array_equal(topk_selection(scores, 4), [[1, 2, 5, 0], [0, -1, -1, -1]])
    np.testing.assert_array_equal(topk_selection(scores, 8)[0], [1, 2, 5, 0, -1, -1, -1, -1])


@pytest.fixture(scope="module")
def with_indexer(reference):
    return Reference(reference.weights, reference.config, random_indexer_weights(7))


def test_indexer_against_loops(with_indexer, heldout):
    ref, icfg = with_indexer, IndexerConfig()
    layer, n = 4, 12
    x = ref.layer_inputs(heldout[:n])[layer].astype(np.float64)
    q, w, k = ref.indexer(layer, x)
    z = ref.index_scores(layer, q, w, k)
    wi = {name.split(".indexer.")[1]: a.astype(np.float64)
          for name, a in ref.indexer_weights.items() if name.startswith(f"blk.{layer}.")}
    theta = 100000.0 ** (-np.arange(16) * 2 / 32)
    for t in range(n):
        qt = (wi["q_b.weight"] @ (wi["q_a.weight"] @ x[t])).reshape(16, 64)
        kt = wi["k.weight"] @ x[t]
        kt = (kt - kt.mean()) / np.sqrt(kt.var() + 1e-6) * wi["k_norm.weight"] \
            + wi["k_norm.bias"]
        rot = np.exp(1j * t * theta)
        for v in (qt, kt):
            c = (v[..., 0:32:2] + 1j * v[..., 1:32:2]) * rot
            v[..., 0:32:2], v[..., 1:32:2] = c.real, c.imag
        wt = wi["weights_proj.weight"] @ x[t] / np.sqrt(16) / np.sqrt(64)
        np.testing.assert_allclose(q[t], qt, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(k[t], kt, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(w[t], wt, rtol=2e-4, atol=1e-5)
    for t in range(n):
        for i in range(n):
            if i > t:
                assert z[t, i] == -np.inf
            else:
                expect = sum(w[t, h] * max(0.0, float(q[t, h] @ k[i])) for h in range(16))
                assert z[t, i] == pytest.approx(expect, rel=1e-4, abs=1e-5)


def test_indexer_selection_with_every_slot_equals_dense(with_indexer, heldout):
    tokens = heldout[300:364]

    def select(layer, x):
        q, w, k = with_indexer.indexer(layer, x)
        return topk_selection(with_indexer.index_scores(layer, q, w, k), 2048)

    assert np.array_equal(with_indexer.forward(tokens, select), with_indexer.forward(tokens))


def test_indexer_file(tmp_path, reference):
    path = tmp_path / "indexer.safetensors"
    weights = random_indexer_weights(3)
    write_indexer_weights(weights, IndexerConfig(), path, "ab" * 32, settings={"steps": "10"})
    loaded, config = load_indexer_weights(path, base_model_sha256="ab" * 32)
    assert config == IndexerConfig()
    for name, array in weights.items():
        np.testing.assert_array_equal(loaded[name], array)
    ref = Reference(reference.weights, reference.config, path)
    x = np.ones((3, 576), np.float32)
    assert ref.indexer(0, x)[0].shape == (3, 16, 64)
    with pytest.raises(ModelFileError, match="base_model_sha256 is 'abab.*expected 'cd"):
        load_indexer_weights(path, base_model_sha256="cd" * 32)
    with pytest.raises(ValueError, match="no indexer weights"):
        reference.indexer(0, x)
