"""TF's fused BatchNorm kernel in training against float64, one layer at a time.

    python -m benchmarks.bn_kernel_accuracy
    TF_ENABLE_ONEDNN_OPTS=0 python -m benchmarks.bn_kernel_accuracy

FusedBatchNormV3 (is_training, NHWC; oneDNN's kernel when oneDNN is on,
Eigen's otherwise) on float32 inputs of several shapes and offsets, against
the same layer computed in float64 with NumPy: the largest error of the
output, the batch variance (Bessel-corrected, as the kernel returns it) and
the gradients of x, gamma and beta, relative to the reference's largest
magnitude. Whole networks compound such errors over their depth
(docs/design/onednn.md); this isolates the kernel.
"""
import numpy as np
import tensorflow as tf

EPSILON = 1e-3
# (mean, std, shape): centred; offset with a small spread (cancellation in a
# one-pass variance would show); one pixel per image; a larger batch.
CASES = [(0.0, 1.0, (8, 4, 4, 32)), (5.0, 0.1, (8, 4, 4, 32)),
         (0.0, 1.0, (8, 1, 1, 32)), (2.0, 0.5, (64, 8, 8, 32))]


def reference(x, gamma, beta, dy):
  """Output, dx, dgamma, dbeta, population variance, in float64."""
  x = x.astype(np.float64)
  axes = (0, 1, 2)
  n = x.size // x.shape[-1]
  mean, var = x.mean(axes), x.var(axes)
  inv = 1.0 / np.sqrt(var + EPSILON)
  normed = (x - mean) * inv
  dgamma, dbeta = (dy * normed).sum(axes), dy.sum(axes)
  dx = gamma * inv / n * (n * dy - dbeta - normed * dgamma)
  return gamma * normed + beta, dx, dgamma, dbeta, var


@tf.function
def fused(x, gamma, beta, dy):
  with tf.GradientTape() as tape:
    tape.watch([x, gamma, beta])
    y, _, variance, *_ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=gamma, offset=beta, mean=tf.zeros([0]),
        variance=tf.zeros([0]), epsilon=EPSILON, is_training=True)
    loss = tf.reduce_sum(y * dy)
  return (y, variance, *tape.gradient(loss, [x, gamma, beta]))


def main():
  rng = np.random.default_rng(0)
  print("| input mean, std | shape | output | variance | dx | dgamma | dbeta |")
  print("|---|---|---|---|---|---|---|")
  for mean, std, shape in CASES:
    x = (rng.normal(size=shape) * std + mean).astype(np.float32)
    gamma, beta = (rng.normal(size=shape[-1]).astype(np.float32)
                   for _ in range(2))
    dy = rng.normal(size=shape).astype(np.float32)
    y, variance, dx, dgamma, dbeta = (t.numpy() for t in fused(
        x, gamma, beta, dy))
    ry, rdx, rdgamma, rdbeta, rvar = reference(x, gamma, beta, dy)
    n = x.size // shape[-1]
    errors = [np.abs(a - r).max() / np.abs(r).max() for a, r in (
        (y, ry), (variance, rvar * n / (n - 1)), (dx, rdx),
        (dgamma, rdgamma), (dbeta, rdbeta))]
    print(f"| {mean}, {std} | {shape} | " +
          " | ".join(f"{e:.1e}" for e in errors) + " |")


if __name__ == "__main__":
  main()
