"""
Batch independence: LayerNorm versus BatchNorm
==============================================

LayerNorm normalizes each sample with its own statistics, so a sample's output cannot
depend on the other samples in the batch. This library makes that hold *bit for bit*:
each row is reduced in one fixed order, whatever the batch size, the row's position and
the number of threads. BatchNorm, which normalizes each feature over the batch, gives a
different answer for the same sample when its neighbours change.
"""

# %%
import numpy as np

import layernorm as ln

rng = np.random.default_rng(0)
D = 768
token = rng.standard_normal((1, D), dtype=np.float32)

# A batch of 4096 tokens with large values, our token hidden at position 1234.
batch = (1e4 * rng.standard_normal((4096, D))).astype(np.float32)
batch[1234] = token[0]

alone = ln.layer_norm(token)
inside = ln.layer_norm(batch)[1234:1235]
print("max |alone - inside batch| =", np.abs(alone - inside).max())
print("bitwise equal:", np.array_equal(alone, inside))
assert np.array_equal(alone, inside)

# %%
# The batch above is large enough (3 million elements) to be split over all CPU
# threads. By default the library runs a size's first calls on one thread and moves to
# the parallel kernels once it has measured that they pay, so the calls above may all
# have been serial; ``LAYERNORM_PARALLEL=always`` (read at import) forces the parallel
# kernels, ``never`` the serial ones. Two fresh processes, one forced each way, give
# the same bits as this one:
import os
import subprocess
import sys
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    np.save(os.path.join(tmp, "batch.npy"), batch)
    script = ("import sys, numpy as np, layernorm as ln; "
              "np.save(sys.argv[2], ln.layer_norm(np.load(sys.argv[1])))")
    results = {}
    for policy in ("always", "never"):
        path = os.path.join(tmp, f"{policy}.npy")
        subprocess.run([sys.executable, "-c", script, os.path.join(tmp, "batch.npy"), path],
                       check=True, env=dict(os.environ, LAYERNORM_PARALLEL=policy))
        results[policy] = np.load(path)
here = ln.layer_norm(batch)
for policy, y in results.items():
    print(f"LAYERNORM_PARALLEL={policy} vs this process, bitwise equal:",
          np.array_equal(y, here))
    assert np.array_equal(y, here)

# %%
# A small BatchNorm in NumPy
# --------------------------
# BatchNorm (training mode) normalizes each *feature* over the batch axis. The same
# token now gets a different output depending on what it is batched with.


def batch_norm(x, eps=1e-5):
    """Training-mode BatchNorm over axis 0, no affine parameters."""
    mean = x.mean(axis=0, keepdims=True)
    var = x.var(axis=0, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


small_batch = np.concatenate([token, rng.standard_normal((7, D), dtype=np.float32)])
bn_small = batch_norm(small_batch)[0]
bn_large = batch_norm(batch)[1234]
print("BatchNorm, token in a batch of 8 normal tokens: ", bn_small[:4].round(4))
print("BatchNorm, token in a batch of 4096 large ones: ", bn_large[:4].round(4))
print("max |difference| =", np.abs(bn_small - bn_large).max())
print("LayerNorm, either way:                          ", alone[0, :4].round(4))
