"""A synthetic text-to-image task for the tiny CPU demo: coloured shapes in quadrants.

Prompts read "a <colour> <shape> in the <position>", e.g. "a red square in the top left", with
4 colours x 2 shapes x 4 quadrants = 32 prompts. A prompt is carried as a row of attribute ids
``(colour, shape, position)`` indexing :data:`COLORS`, :data:`SHAPES` and :data:`POSITIONS`.

Images are (3, H, W) in [-1, 1]: a black (-1) background and one 6x6-px shape (a filled square,
or a plus sign with 2-px arms) at full intensity in the prompt's colour, inside the prompt's
quadrant, in the corner of that quadrant that is the image's corner. Shapes sit on the 2x2-pixel
grid that ``pack_latents`` turns into tokens, so each token is wholly on or off. With
``jitter=True`` the shape is instead placed uniformly among the token-aligned positions inside
its quadrant. Off by default: with several placements per prompt a briefly trained model's
few-step samples blend them into a blob (the shape score then stalls near 0.3), and the CPU demo
cannot afford the training that resolves it.

Label noise (``ShapesTask.label_noise``): :meth:`ShapesTask.render` draws, with that
probability per sample, an image whose colour OR position (half the time each) is a uniformly
drawn *other* value than the prompt says. The shape is always honest. A model pretrained on such
pairs follows prompts only partially (at label_noise 0.25 a perfect fit gets the colour and the
quadrant right 87.5% of the time each, and a briefly trained one blends colours and quadrants
more often still), which leaves the RL stage a prompt-following gap to close.

Text encoder: a frozen, deterministic stand-in for T5/CLIP. Each prompt is the fixed 7-word
template tokenised by words, right-padded with ``<pad>`` to ``text_len``; token embeddings come
from a fixed random table seeded by ``embedding_seed``; the pooled vector is a fixed random
projection of the mean non-pad token embedding. No positional embedding: every attribute has its
own words, so the bag of tokens already identifies the prompt (and FLUX gets all-zero text ids).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
SHAPES: tuple[str, ...] = ("square", "cross")
POSITIONS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right")

# RGB in [0, 1] of each colour in COLORS; channels are drawn at full intensity or off.
COLOR_RGB = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]], np.float32)
# Side (px) of a shape's box: 3x3 tokens.
SHAPE_SIZE = 6
# Shapes are placed on this pixel grid: the 2x2 patches that become the model's tokens.
PLACEMENT_STEP = 2

PAD = "<pad>"
VOCAB: tuple[str, ...] = (PAD, "a", "in", "the", *COLORS, *SHAPES, "top", "bottom", "left", "right")
_TOKEN = {word: i for i, word in enumerate(VOCAB)}
PROMPT_LEN = 7  # "a <colour> <shape> in the <top|bottom> <left|right>"


def shape_mask(shape: jax.Array, y: jax.Array, x: jax.Array) -> jax.Array:
    """Boolean mask of shape id ``shape`` at pixel offsets (y, x) from its box's top-left pixel.

    Arguments broadcast. The box is SHAPE_SIZE px square; a square fills it, a cross keeps its
    centred 2-px-wide horizontal and vertical bars (1 token wide).
    """
    inside = (y >= 0) & (y < SHAPE_SIZE) & (x >= 0) & (x < SHAPE_SIZE)
    # |2y - (SIZE - 1)| <= 1 selects the two middle rows of the (even-sized) box.
    bar = (jnp.abs(2 * y - (SHAPE_SIZE - 1)) <= 1) | (jnp.abs(2 * x - (SHAPE_SIZE - 1)) <= 1)
    return inside & ((shape == 0) | bar)


@functools.lru_cache(maxsize=None)
def _encoder_tables(seed: int, embed_dim: int, pooled_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(token table (|VOCAB|, embed_dim), pooled projection (embed_dim, pooled_dim)), fixed by seed."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((len(VOCAB), embed_dim)).astype(np.float32)
    # The pooled input is a mean of PROMPT_LEN unit-variance tokens: scale it back to about unit variance.
    scale = np.sqrt(PROMPT_LEN / embed_dim)
    projection = (rng.standard_normal((embed_dim, pooled_dim)) * scale).astype(np.float32)
    return table, projection


@dataclasses.dataclass(frozen=True)
class ShapesTask:
    """The coloured-shapes text-to-image task (see the module docstring).

    Attributes:
      resolution: image side in pixels; a multiple of 4 and >= 16 (quadrants of whole tokens,
        each holding the 6-px shape with room to spare).
      text_len: padded prompt length in tokens (>= 7, the prompt template's length).
      embed_dim: text embedding width (the model's ``joint_attention_dim``).
      pooled_dim: pooled text vector width (the model's ``pooled_projection_dim``).
      label_noise: probability that a rendered image disagrees with its prompt in one attribute.
      embedding_seed: seed of the frozen text-encoder tables.
      jitter: place shapes uniformly among the token-aligned positions in their quadrant
        instead of in its outer corner.

    Array methods take and return jax arrays and trace under ``jit`` (the task is hashable, so it
    can be a static argument).
    """

    resolution: int = 16
    text_len: int = 8
    embed_dim: int = 32
    pooled_dim: int = 32
    label_noise: float = 0.25
    embedding_seed: int = 1234
    jitter: bool = False

    def __post_init__(self):
        if self.resolution % (2 * PLACEMENT_STEP) or self.resolution < 16:
            raise ValueError(f"resolution must be a multiple of {2 * PLACEMENT_STEP} and >= 16, got {self.resolution}")
        if self.text_len < PROMPT_LEN:
            raise ValueError(f"text_len must be >= {PROMPT_LEN} (the prompt length in tokens), got {self.text_len}")
        if not 0.0 <= self.label_noise <= 1.0:
            raise ValueError(f"label_noise must be in [0, 1], got {self.label_noise}")

    # Prompts.

    def sample_prompts(self, key: jax.Array, n: int) -> jax.Array:
        """(n, 3) int32 attribute ids (colour, shape, position), each uniform and independent."""
        sizes = jnp.array([len(COLORS), len(SHAPES), len(POSITIONS)])
        return jax.random.randint(key, (n, 3), 0, sizes, dtype=jnp.int32)

    @staticmethod
    def all_prompt_ids() -> jax.Array:
        """(32, 3) int32: every (colour, shape, position) combination once, colour-major."""
        grid = np.stack(np.meshgrid(*(np.arange(len(a)) for a in (COLORS, SHAPES, POSITIONS)), indexing="ij"), -1)
        return jnp.asarray(grid.reshape(-1, 3), jnp.int32)

    @staticmethod
    def prompt_text(ids) -> list[str]:
        """The prompt strings of (n, 3) attribute ids, e.g. "a red square in the top left"."""
        return [f"a {COLORS[c]} {SHAPES[s]} in the {POSITIONS[p]}" for c, s, p in np.asarray(ids).tolist()]

    @staticmethod
    def prompt_metadata(ids) -> list[dict]:
        """Per prompt {'color', 'shape', 'position'} attribute names (what the reward reads)."""
        return [
            {"color": COLORS[c], "shape": SHAPES[s], "position": POSITIONS[p]}
            for c, s, p in np.asarray(ids).tolist()
        ]

    # Text encoder.

    def tokens(self, ids: jax.Array) -> jax.Array:
        """(n, text_len) int32 token ids of the prompts, right-padded with ``<pad>``."""
        ids = jnp.asarray(ids, jnp.int32)
        color, shape, pos = ids[:, 0], ids[:, 1], ids[:, 2]
        n = ids.shape[0]
        const = lambda word: jnp.full((n,), _TOKEN[word], jnp.int32)  # noqa: E731
        words = [
            const("a"),
            _TOKEN[COLORS[0]] + color,
            _TOKEN[SHAPES[0]] + shape,
            const("in"),
            const("the"),
            jnp.where(pos // 2 == 0, _TOKEN["top"], _TOKEN["bottom"]),
            jnp.where(pos % 2 == 0, _TOKEN["left"], _TOKEN["right"]),
        ] + [const(PAD)] * (self.text_len - PROMPT_LEN)
        return jnp.stack(words, axis=1)

    def encode(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Frozen text encoding of (n, 3) attribute ids.

        Returns (text embeddings (n, text_len, embed_dim), pooled (n, pooled_dim)), float32. A
        pure function of ``ids`` and the task's fields: the same prompt always encodes the same.
        """
        table, projection = _encoder_tables(self.embedding_seed, self.embed_dim, self.pooled_dim)
        text = jnp.asarray(table)[self.tokens(ids)]
        # Pad embeddings stay in the text sequence (FLUX gets no mask) but not in the pooled mean.
        pooled = jnp.mean(text[:, :PROMPT_LEN], axis=1) @ jnp.asarray(projection)
        return text, pooled

    # Images.

    def corrupt_labels(self, ids: jax.Array, key: jax.Array) -> jax.Array:
        """The attributes an image is drawn with: ``ids`` with label noise applied.

        Per sample, with probability ``label_noise``, the colour or the position (each half the
        time) is replaced by a uniformly drawn different value; the shape is never changed.
        """
        ids = jnp.asarray(ids, jnp.int32)
        n = ids.shape[0]
        k_flip, k_which, k_offset = jax.random.split(key, 3)
        flip = jax.random.uniform(k_flip, (n,)) < self.label_noise
        which = jnp.where(jax.random.bernoulli(k_which, 0.5, (n,)), 2, 0)  # column: position or colour
        num_values = jnp.where(which == 2, len(POSITIONS), len(COLORS))
        # value + uniform{1..K-1} mod K is uniform over the K - 1 other values.
        offset = jax.random.randint(k_offset, (n,), 1, num_values)
        current = jnp.take_along_axis(ids, which[:, None], axis=1)[:, 0]
        new = jnp.where(flip, (current + offset) % num_values, current)
        return ids.at[jnp.arange(n), which].set(new)

    def draw(self, ids: jax.Array, key: jax.Array) -> jax.Array:
        """(n, 3, H, W) float32 images in {-1, 1} showing exactly the attributes ``ids``.

        The shape's box touches the image corner inside its quadrant; with ``jitter`` its
        distance from that corner is uniform over {0, 2, ..., H/2 - 6} px per axis (``key`` is
        unused otherwise).
        """
        ids = jnp.asarray(ids, jnp.int32)
        n, res = ids.shape[0], self.resolution
        if self.jitter:
            room = (res // 2 - SHAPE_SIZE) // PLACEMENT_STEP + 1  # placements per axis
            inset = PLACEMENT_STEP * jax.random.randint(key, (2, n), 0, room)
        else:
            inset = jnp.zeros((2, n), jnp.int32)
        far = res - SHAPE_SIZE  # box origin when it touches the bottom / right image edge
        top = jnp.where(ids[:, 2] // 2 == 0, inset[0], far - inset[0])
        left = jnp.where(ids[:, 2] % 2 == 0, inset[1], far - inset[1])
        grid = jnp.arange(res)
        y = grid[None, :, None] - top[:, None, None]
        x = grid[None, None, :] - left[:, None, None]
        mask = shape_mask(ids[:, 1, None, None], y, x)  # (n, H, W)
        rgb = jnp.asarray(COLOR_RGB)[ids[:, 0]]  # (n, 3)
        on = mask[:, None] & (rgb[:, :, None, None] > 0)
        return jnp.where(on, 1.0, -1.0).astype(jnp.float32)

    def render(self, ids: jax.Array, key: jax.Array) -> jax.Array:
        """Training images for prompts ``ids``: ``draw(corrupt_labels(ids, k1), k2)``, (k1, k2) = split(key).

        (n, 3, H, W) float32 in {-1, 1}; with probability ``label_noise`` an image shows a
        different colour or quadrant than its prompt (see :meth:`corrupt_labels`).
        """
        k_labels, k_draw = jax.random.split(key)
        return self.draw(self.corrupt_labels(ids, k_labels), k_draw)
