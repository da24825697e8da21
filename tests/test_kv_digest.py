"""engine/kv_transfer/digest.py:
the jax transport's device digest of K/V pages changes with any bit,
with the order of pages and with the field, and host and device copies agree."""

import jax
import jax.numpy as jnp
import numpy as np

from engine.kv_transfer.digest import device_digest


def pages(dtype=np.float32):
    return np.random.RandomState(0).randn(2, 2, 4, 8, 16).astype(dtype)  # [L, K, n, ps, hd]


def test_digest_detects_a_flipped_bit_and_swapped_pages():
    k, v = pages(), pages() + 1
    base = device_digest({"k_pages": k, "v_pages": v})
    assert base == device_digest({"k_pages": jax.device_put(k), "v_pages": jax.device_put(v)})
    assert base.startswith("k_pages:") and ",v_pages:" in base
    flipped = k.copy()
    flipped.view(np.uint32)[1, 1, 3, 7, 15] ^= 1 << 9
    swapped = k.copy()
    swapped[:, :, [0, 1]] = k[:, :, [1, 0]]
    others = [
        device_digest({"k_pages": flipped, "v_pages": v}),
        device_digest({"k_pages": swapped, "v_pages": v}),
        device_digest({"k_pages": v, "v_pages": k}),
    ]
    assert len({base, *others}) == 4


def test_digest_covers_narrow_dtypes_and_scales():
    q = (pages() * 40).astype(np.int8)
    scales = np.ones((2, 2, 4, 8), np.float32)
    base = device_digest({"k_pages": q, "k_scales": scales})
    q2 = q.copy()
    q2[0, 0, 0, 0, 0] ^= 1
    assert device_digest({"k_pages": q2, "k_scales": scales}) != base
    assert device_digest({"k_pages": q, "k_scales": scales * 2}) != base
    bf = jnp.asarray(pages()).astype(jnp.bfloat16)
    assert device_digest({"k_pages": bf}) != device_digest({"k_pages": bf + 1})
