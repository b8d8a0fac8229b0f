"""Sentiment of short reviews: strings vectorized in the input pipeline, a
small Transformer encoder, two outputs (the sentiment and, as an auxiliary
task, the review's length bucket) and Keras metric objects (AUC, precision,
recall).

The reviews are generated (words from positive, negative and neutral lists,
a label the words decide, 3% of labels flipped), so the script runs
anywhere; replace `make_reviews` with your own reader of (text, label) pairs.

    python -m examples.text_classifier --cpu_devices=2 --train_steps=300 \
        --model_dir=/tmp/reviews
    python -m engine.launch --num_workers=2 --module=examples.text_classifier \
        -- --train_steps=300 --model_dir=/tmp/reviews_2w

The vocabulary is counted once from the training texts and saved as
`<model_dir>/vocabulary.txt`; a run that finds that file (a resumed one)
uses it, so the checkpoint's embeddings and the export keep their meaning.
The export (`<model_dir>/export/saved_model`) takes raw strings:

    served = tf.saved_model.load("/tmp/reviews/export/saved_model")
    out = served.signatures["serving_default"](
        text=tf.constant(["a wonderful film", "dull and boring"]))
    out["sentiment"]  # logits [2]: above 0 is positive
    out["length"]     # logits [2, 4] of the length buckets
"""
import collections
import hashlib
import os
import string
from typing import Dict, List, Tuple

from absl import flags
import keras
import numpy as np
import tensorflow as tf

import engine

FLAGS = flags.FLAGS
POSITIVE = ("great", "excellent", "loved", "wonderful", "superb", "delightful",
            "brilliant", "enjoyable", "charming", "fantastic", "moving",
            "fun")
NEGATIVE = ("awful", "boring", "terrible", "dull", "hated", "poor", "bland",
            "tedious", "messy", "weak", "clumsy", "worst")
NEUTRAL = ("the", "a", "movie", "film", "plot", "actors", "story", "scene",
           "music", "it", "was", "and", "is", "of", "director", "ending",
           "camera", "cast", "script", "this", "with", "very", "quite", "but",
           "some", "two", "hours", "long", "seen", "again")
# A review has MIN_WORDS..MAX_WORDS words; each carries sentiment with
# probability SENTIMENT_WORDS, the review's own with probability AGREEING
# (else the opposite one); LABEL_NOISE of the labels are flipped. A bag of
# words then reaches an AUC of about 0.95: learnable, not trivially 1.0.
MIN_WORDS, MAX_WORDS = 4, 23
SENTIMENT_WORDS, AGREEING, LABEL_NOISE = 0.35, 0.85, 0.03
LENGTH_BUCKETS = 4  # the auxiliary output: word counts in 4 equal ranges
VOCABULARY_FILE = "vocabulary.txt"


def define_flags():
  """The script's own flags (next to the engine's, which engine.cli adds)."""
  flags.DEFINE_integer("reviews", 3000, "Generated reviews (20% held out).")
  flags.DEFINE_integer("data_seed", 0, "Seed of the generated reviews.")
  flags.DEFINE_integer("sequence_length", 24, "Tokens per review (padded or "
                       "cut).")
  flags.DEFINE_integer("max_tokens", 1000, "Largest vocabulary (with the "
                       "padding and out-of-vocabulary tokens).")
  flags.DEFINE_integer("width", 32, "Embedding and attention width.")
  flags.DEFINE_integer("attention_blocks", 1, "Transformer encoder blocks.")
  flags.DEFINE_integer("heads", 2, "Attention heads per block.")
  flags.DEFINE_float("length_weight", 0.2, "Weight of the length bucket's "
                     "loss (the sentiment's is 1).")


def make_reviews(count: int, seed: int
                 ) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
  """Texts [count] and labels {"sentiment": float32 0/1, "length": int32
  bucket of the word count}."""
  rng = np.random.default_rng(seed)
  texts, sentiment, length = [], [], []
  for _ in range(count):
    positive = bool(rng.integers(2))
    words = int(rng.integers(MIN_WORDS, MAX_WORDS + 1))
    review = []
    for _ in range(words):
      if rng.random() < SENTIMENT_WORDS:
        agrees = rng.random() < AGREEING
        pool = POSITIVE if positive == agrees else NEGATIVE
      else:
        pool = NEUTRAL
      review.append(pool[rng.integers(len(pool))])
    texts.append(" ".join(review))
    sentiment.append(float(positive != (rng.random() < LABEL_NOISE)))
    length.append(length_bucket(words))
  return np.array(texts), {"sentiment": np.array(sentiment, np.float32),
                           "length": np.array(length, np.int32)}


def length_bucket(words: int) -> int:
  span = (MAX_WORDS - MIN_WORDS + 1) / LENGTH_BUCKETS
  return min(int((words - MIN_WORDS) // span), LENGTH_BUCKETS - 1)


def tokens(text: str) -> List[str]:
  """The tokens TextVectorization's default standardization and split make
  of an ASCII text: lower case, punctuation removed, split on whitespace."""
  return text.lower().translate(
      str.maketrans("", "", string.punctuation)).split()


def count_vocabulary(texts, max_tokens: int) -> List[str]:
  """The most frequent tokens, ties by the token: the same list wherever it
  is computed (every worker can, from the same texts)."""
  counts = collections.Counter(t for text in texts for t in tokens(text))
  ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
  # TextVectorization adds the padding ("") and out-of-vocabulary tokens.
  return [token for token, _ in ranked[:max_tokens - 2]]


def read_vocabulary(path: str) -> List[str]:
  with open(path, encoding="utf-8") as f:
    return f.read().splitlines()


def write_vocabulary(path: str, vocabulary: List[str]) -> None:
  """Atomically: a reader (a resume, another worker) never sees half a file."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "w", encoding="utf-8") as f:
    f.write("".join(f"{token}\n" for token in vocabulary))
  os.replace(temporary, path)


def build_model(vocabulary_size: int, sequence_length: int, width: int,
                blocks: int, heads: int) -> keras.Model:
  """Token ids [batch, sequence_length] -> {"sentiment": logit [batch],
  "length": logits [batch, LENGTH_BUCKETS]}."""
  ids = keras.Input((sequence_length,), dtype="int64", name="tokens")
  # Padding (id 0) is masked out of the attention and of the pooling.
  x = keras.layers.Embedding(vocabulary_size, width, mask_zero=True)(ids)
  positions = keras.ops.cumsum(keras.ops.ones_like(ids), axis=1) - 1
  x = keras.layers.Add()(
      [x, keras.layers.Embedding(sequence_length, width)(positions)])
  for _ in range(blocks):  # pre-norm encoder blocks
    h = keras.layers.LayerNormalization()(x)
    h = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
    x = keras.layers.Add()([x, h])
    h = keras.layers.LayerNormalization()(x)
    h = keras.layers.Dense(2 * width, activation="gelu")(h)
    x = keras.layers.Add()([x, keras.layers.Dense(width)(h)])
  pooled = keras.layers.GlobalAveragePooling1D()(
      keras.layers.LayerNormalization()(x))
  sentiment = keras.ops.squeeze(keras.layers.Dense(1)(pooled), axis=-1)
  length = keras.layers.Dense(LENGTH_BUCKETS)(pooled)
  return keras.Model(ids, {"sentiment": sentiment, "length": length},
                     name="review_encoder")


class ReviewSentiment(engine.Task):
  """Reviews as strings; `preprocess_batch` turns each batch into token ids.

  The loss, its weights and the metrics are what `model.compile(loss={...},
  loss_weights={...}, metrics={...})` would take (the losses with
  reduction=None: one value per example).
  """
  # `preprocess_batch` has no Python branch on a tensor: tf.data need not
  # convert it with AutoGraph, and the run starts sooner.
  autograph = False

  def __init__(self, *, reviews: int, data_seed: int, model_dir: str,
               sequence_length: int = 24, max_tokens: int = 1000,
               width: int = 32, attention_blocks: int = 1, heads: int = 2,
               length_weight: float = 0.2):
    super().__init__(
        name="review_sentiment",
        # As compile(loss={...}, loss_weights={...}): one loss per output.
        loss={"sentiment": keras.losses.BinaryCrossentropy(
                  from_logits=True, reduction=None),
              "length": keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True, reduction=None)},
        loss_weights={"length": length_weight},
        # Logits: precision and recall count a logit above 0 as positive.
        metrics={"sentiment": [keras.metrics.AUC(from_logits=True),
                               keras.metrics.Precision(thresholds=0.0),
                               keras.metrics.Recall(thresholds=0.0)],
                 "length": {"accuracy": engine.classification.accuracy}})
    self.texts, self.labels = make_reviews(reviews, data_seed)
    self.cut = reviews * 4 // 5
    self.vocabulary_path = os.path.join(model_dir, VOCABULARY_FILE)
    # A saved vocabulary wins: a resumed run and its export use the ids the
    # checkpoint's embeddings were trained on.
    self.vocabulary = (read_vocabulary(self.vocabulary_path)
                       if os.path.exists(self.vocabulary_path) else
                       count_vocabulary(self.texts[:self.cut], max_tokens))
    self.sequence_length = sequence_length
    self.shape = dict(width=width, blocks=attention_blocks, heads=heads)
    self._vectorizer = None

  def vectorizer(self) -> keras.layers.TextVectorization:
    """The layer that maps strings to token ids, made on the first call
    (`build_inputs`'s, eager: its lookup table is not made inside the trace
    of tf.data's map, which would keep it there)."""
    if self._vectorizer is None:
      self._vectorizer = keras.layers.TextVectorization(
          vocabulary=self.vocabulary,
          output_sequence_length=self.sequence_length)
    return self._vectorizer

  def build_model(self):
    # The vocabulary and the two special ids.
    return build_model(len(self.vocabulary) + 2, self.sequence_length,
                       **self.shape)

  def build_inputs(self, split, context):
    if context.input_pipeline_id == 0 and not os.path.exists(
        self.vocabulary_path):
      write_vocabulary(self.vocabulary_path, self.vocabulary)  # the chief
    self.vectorizer()  # made here, before tf.data traces preprocess_batch
    part = slice(0, self.cut) if split == "train" else slice(self.cut, None)
    return tf.data.Dataset.from_tensor_slices(
        (self.texts[part], {k: v[part] for k, v in self.labels.items()}))

  def preprocess_batch(self, features, labels, training):
    del training
    return self.vectorizer()(features), labels

  def describe(self):
    # A checkpoint resumes only with the same vocabulary and model.
    digest = hashlib.sha256("\n".join(self.vocabulary).encode()).hexdigest()
    return {"task": self.name, "vocabulary_size": len(self.vocabulary),
            "vocabulary_sha256": digest[:16],
            "sequence_length": self.sequence_length, **self.shape}

  def serving_features(self):
    # The SavedModel takes raw strings and vectorizes them itself.
    return (tf.TensorSpec([None], tf.string, name="text"), self.vectorizer())


def make_task(config: engine.Config) -> engine.Task:
  return ReviewSentiment(
      reviews=FLAGS.reviews, data_seed=FLAGS.data_seed,
      model_dir=config.checkpoints.model_dir,
      sequence_length=FLAGS.sequence_length, max_tokens=FLAGS.max_tokens,
      width=FLAGS.width, attention_blocks=FLAGS.attention_blocks,
      heads=FLAGS.heads, length_weight=FLAGS.length_weight)


if __name__ == "__main__":
  define_flags()
  engine.cli.run(make_task)
