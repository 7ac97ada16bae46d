"""Attention distillation: pull a student's attention maps towards a teacher's.

- `AttentionDistillationLoss`: KL(teacher || student) between the attention rows of mapped
  layers and heads, averaged over the real (unpadded) query rows.
- `AttentionDistiller`: a `keras.Model` wrapping a student and a frozen teacher; `fit`
  trains the student on its own loss plus `attention_weight` x the attention KL, both
  reported as metrics (`student_loss`, `attention_loss`).

Both models' attention probabilities are taken inside the train step with
`kzoo.layers.taps.Tap` (the exact softmax formula runs while a tap is active), so the KL is
differentiated through the student's attention on every backend, and nothing changes in
either model: `distiller.student` is the plain student afterwards.

Layer mapping (student depth `Ls`, teacher depth `Lt`): student layer `i` learns from teacher
layer `round((i + 1) * Lt / Ls) - 1` (rounded half up), i.e. the student's last layer from
the teacher's last, the others spread evenly below it; or a user-given list. Head mapping
(student `Hs` heads, teacher `Ht`): when `Ht` is a multiple of `Hs`, student head `h` learns
the mean of teacher heads `h*g ... h*g + g - 1` (`g = Ht / Hs`; the mean of probability rows
is a probability row); when `Hs` is a multiple of `Ht`, each teacher head teaches `Hs / Ht`
consecutive student heads; or a user-given list (one teacher head, or a list of heads to
average, per student head).

Example:
>>> teacher = kzoo.presets.load("gpt_mini", num_layers=4)      # trained beforehand
>>> student = kzoo.presets.load("gpt_mini", num_layers=2, num_heads=2, hidden_dim=64,
...                             intermediate_dim=256)
>>> distiller = AttentionDistiller(student, teacher, attention_weight=1.0)
>>> distiller.compile(optimizer="adamw")        # the student's default loss + attention KL
>>> x, y, w = kzoo.models.gpt.GPTCausalLM.lm_batch(np.random.randint(0, 256, (8, 33)))
>>> distiller.fit(x, y, sample_weight=w, epochs=1)      # logs loss, student_loss, attention_loss
>>> kzoo.presets.save(distiller.student, "student")
"""

import math
import numbers
import re

import keras
import numpy as np
from keras import ops

from kzoo.layers.attention import MultiHeadAttention
from kzoo.layers.taps import RetracesUnderTaps, Tap


# === Mappings ===


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def default_layer_map(num_student, num_teacher):
    """Student layer `i` <- teacher layer `round((i + 1) * num_teacher / num_student) - 1`
    (rounded half up): evenly spread, last onto last.

    Example:
    >>> default_layer_map(2, 4)
    [1, 3]
    """
    return [int(math.floor((i + 1) * num_teacher / num_student + 0.5)) - 1
            for i in range(num_student)]


def _check_layer_map(layer_map, num_student=None, num_teacher=None):
    """`layer_map` as a list of ints (None stays None), checked against the depths when
    they are given."""
    if layer_map is None:
        return None
    if isinstance(layer_map, (str, bytes)) or not hasattr(layer_map, "__iter__"):
        raise ValueError(f"`layer_map` must be None or a list of teacher layer indices, one "
                         f"per student layer; got layer_map={layer_map!r}.")
    values = list(layer_map)
    if not all(_is_int(v) for v in values) or not values:
        raise ValueError(f"`layer_map` must be a non-empty list of integers (a teacher layer "
                         f"index per student layer); got layer_map={layer_map!r}.")
    values = [int(v) for v in values]
    if num_student is not None and len(values) != num_student:
        raise ValueError(f"`layer_map` must have one entry per student attention layer "
                         f"({num_student}); got {len(values)}: layer_map={values!r}.")
    if num_teacher is not None and any(v < 0 or v >= num_teacher for v in values):
        raise ValueError(f"`layer_map` entries must be teacher layer indices in "
                         f"[0, {num_teacher}); got layer_map={values!r}.")
    return values


def _check_head_map(head_map, num_student=None, num_teacher=None):
    """`head_map` as a list of lists of ints (None stays None), checked against the head
    counts when they are given."""
    if head_map is None:
        return None
    if isinstance(head_map, (str, bytes)) or not hasattr(head_map, "__iter__"):
        raise ValueError(f"`head_map` must be None or a list with, per student head, a "
                         f"teacher head or a list of teacher heads; got head_map={head_map!r}.")
    groups = []
    for entry in head_map:
        if _is_int(entry):
            groups.append([int(entry)])
        elif (not isinstance(entry, (str, bytes)) and hasattr(entry, "__iter__")
              and list(entry) and all(_is_int(v) for v in entry)):
            groups.append([int(v) for v in entry])
        else:
            raise ValueError(f"`head_map` entries must be a teacher head index or a non-empty "
                             f"list of them; got {entry!r} in head_map={head_map!r}.")
    if not groups:
        raise ValueError(f"`head_map` must not be empty; got head_map={head_map!r}.")
    if num_student is not None and len(groups) != num_student:
        raise ValueError(f"`head_map` must have one entry per student head ({num_student}); "
                         f"got {len(groups)}: head_map={head_map!r}.")
    if num_teacher is not None and any(v < 0 or v >= num_teacher for g in groups for v in g):
        raise ValueError(f"`head_map` entries must be teacher heads in [0, {num_teacher}); "
                         f"got head_map={head_map!r}.")
    return groups


def default_head_map(num_student, num_teacher):
    """Per student head, the teacher heads it learns from (averaged): groups of
    `num_teacher / num_student` consecutive heads, or each teacher head repeated
    `num_student / num_teacher` times.

    Example:
    >>> default_head_map(2, 4)
    [[0, 1], [2, 3]]
    """
    if num_teacher % num_student == 0:
        size = num_teacher // num_student
        return [list(range(h * size, (h + 1) * size)) for h in range(num_student)]
    if num_student % num_teacher == 0:
        repeat = num_student // num_teacher
        return [[h // repeat] for h in range(num_student)]
    raise ValueError(
        f"The teacher has {num_teacher} heads and the student {num_student}: neither count "
        f"divides the other, so there is no default grouping; pass `head_map` (per student "
        f"head, a teacher head or a list of teacher heads to average); got head_map=None.")


# === Loss ===


@keras.saving.register_keras_serializable(package="kzoo")
class AttentionDistillationLoss:
    """KL(teacher || student) between attention rows of mapped layers and heads.

    For each student layer `i` and its teacher layer `j = layer_map[i]`, the teacher's
    probabilities are first mapped to the student's heads (`T[h] = mean of the teacher
    heads of head_map[h]`), then per batch element, head and query row

        KL = sum_k T[k] * (log clip(T[k]) - log clip(S[k]))

    with `clip` to `[epsilon, 1]`. Masked keys have probability 0 in both maps and contribute
    0. The loss is the mean of `KL` over the real query rows (`query_mask`), the student's
    heads and the mapped layers. The teacher's maps are under `stop_gradient`.

    Args:
        layer_map: None (default mapping, see the module) or one teacher layer index per
            student layer.
        head_map: None (default grouping, see the module) or, per student head, a teacher
            head index or a list of teacher heads to average.
        epsilon: the clip of the probabilities inside the logarithms, in (0, 0.1].

    Call: `loss(student_maps, teacher_maps, query_mask=None)`, the maps two lists (one
    tensor `(batch, heads, query, key)` per attention layer, in call order), `query_mask`
    `(batch, query)` (1/True = a real query row; None: every row). Returns a float32 scalar.

    Example:
    >>> loss = AttentionDistillationLoss()
    >>> with Tap() as t: teacher(x)
    >>> with Tap() as s: student(x)
    >>> loss([r.weights for r in s.attention_records],
    ...      [r.weights for r in t.attention_records], x["padding_mask"])
    """

    def __init__(self, layer_map=None, head_map=None, epsilon=1e-7):
        self.layer_map = _check_layer_map(layer_map)
        self.head_map = _check_head_map(head_map)
        if not isinstance(epsilon, numbers.Real) or isinstance(epsilon, bool) \
                or not 0 < float(epsilon) <= 0.1:
            raise ValueError(f"`epsilon` must be a number in (0, 0.1]; got epsilon={epsilon!r}.")
        self.epsilon = float(epsilon)

    def layer_pairs(self, num_student, num_teacher):
        """`[(student layer, teacher layer)]` for the given depths."""
        for name, value in (("student_maps", num_student), ("teacher_maps", num_teacher)):
            if value < 1:
                raise ValueError(f"`{name}` must hold at least one attention map; got {value}.")
        if self.layer_map is None:
            if num_student > num_teacher:
                raise ValueError(
                    f"The student has {num_student} attention layers and the teacher only "
                    f"{num_teacher}: the default mapping needs a deeper (or equal) teacher; "
                    f"pass `layer_map`; got layer_map=None.")
            targets = default_layer_map(num_student, num_teacher)
        else:
            targets = _check_layer_map(self.layer_map, num_student, num_teacher)
        return list(enumerate(targets))

    def head_groups(self, num_student, num_teacher):
        """Per student head, the list of teacher heads averaged into its target."""
        if self.head_map is None:
            return default_head_map(num_student, num_teacher)
        return _check_head_map(self.head_map, num_student, num_teacher)

    def head_matrix(self, num_student, num_teacher):
        """`(teacher heads, student heads)` float32 matrix: column `h` averages the teacher
        heads of student head `h`."""
        matrix = np.zeros((num_teacher, num_student), "float32")
        for h, group in enumerate(self.head_groups(num_student, num_teacher)):
            for t in group:
                matrix[t, h] += 1.0 / len(group)
        return matrix

    def layer_kl(self, student, teacher, query_mask=None):
        """Mean row KL of one student map against one teacher map (heads mapped)."""
        student = ops.cast(student, "float32")
        teacher = ops.stop_gradient(ops.cast(teacher, "float32"))
        if len(student.shape) != 4 or len(teacher.shape) != 4:
            raise ValueError(f"Attention maps must be (batch, heads, query, key); got shapes "
                             f"{tuple(student.shape)} and {tuple(teacher.shape)}.")
        hs, ht = int(student.shape[1]), int(teacher.shape[1])
        if hs != ht or self.head_map is not None:
            matrix = ops.convert_to_tensor(self.head_matrix(hs, ht))
            teacher = ops.einsum("bhqk,hs->bsqk", teacher, matrix)
        log_t = ops.log(ops.clip(teacher, self.epsilon, 1.0))
        log_s = ops.log(ops.clip(student, self.epsilon, 1.0))
        rows = ops.mean(ops.sum(teacher * (log_t - log_s), axis=-1), axis=1)  # (batch, q)
        if query_mask is None:
            return ops.mean(rows)
        mask = ops.cast(ops.convert_to_tensor(query_mask), "float32")
        if len(mask.shape) != 2:
            raise ValueError(f"`query_mask` must be (batch, query); got shape "
                             f"{tuple(mask.shape)}.")
        mask = ops.cast(mask > 0, "float32")
        return ops.sum(rows * mask) / ops.maximum(ops.sum(mask), 1.0)

    def __call__(self, student_maps, teacher_maps, query_mask=None):
        student_maps, teacher_maps = list(student_maps), list(teacher_maps)
        pairs = self.layer_pairs(len(student_maps), len(teacher_maps))
        total = 0.0
        for i, j in pairs:
            total = total + self.layer_kl(student_maps[i], teacher_maps[j], query_mask)
        return total / len(pairs)

    def get_config(self):
        return {"layer_map": self.layer_map, "head_map": self.head_map,
                "epsilon": self.epsilon}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# === Distiller ===


def _group_key(layer):
    """The kind of an attention layer: its path without the model prefix and with the block
    indices blanked (`transformer_layer_#/self_attention`; T5: `encoder_layer_#/...`,
    `decoder_layer_#/self_attention`, `decoder_layer_#/cross_attention_layer`)."""
    parts = str(getattr(layer, "path", layer.name)).split("/")
    return re.sub(r"\d+", "#", "/".join(parts[-2:]))


def attention_layers(model):
    """`{kind: [(num_heads), ...]}`: the attention layers of `model` by kind (see
    `_group_key`), with their head counts."""
    groups = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, MultiHeadAttention):
            groups.setdefault(_group_key(layer), []).append(layer.num_heads)
    return groups


def _query_mask(inputs, kind):
    """The real-query mask of the attention layers of `kind` from the model inputs: T5's
    decoder / encoder padding masks, else `padding_mask`; None when the inputs have none."""
    if not isinstance(inputs, dict):
        return None
    if kind.startswith("decoder") and "decoder_padding_mask" in inputs:
        return inputs["decoder_padding_mask"]
    if kind.startswith("encoder") and "encoder_padding_mask" in inputs:
        return inputs["encoder_padding_mask"]
    return inputs.get("padding_mask")


@keras.saving.register_keras_serializable(package="kzoo")
class AttentionDistiller(RetracesUnderTaps, keras.Model):
    """Trains `student` on its own loss plus `attention_weight` x KL(teacher || student)
    of their attention maps (see `AttentionDistillationLoss`), with `teacher` frozen.

    `compile(optimizer, loss="auto", ...)`: "auto" is the student's `default_loss()` (GPT,
    BERT, T5: `kzoo.losses.TokenCrossentropy`); `metrics` / `weighted_metrics` apply to the
    student's predictions. `fit(x, y, sample_weight=...)` takes the student's data. The logs
    hold `loss` (the total), `student_loss` and `attention_loss` (the KL before weighting),
    for training and validation. Calling the distiller returns the student's predictions.

    Attention layers are matched by kind (`transformer_layer_#/self_attention` for GPT,
    BERT, ViT; for T5 encoder self-, decoder self- and cross-attention separately); the KL
    is the mean over kinds. The real query rows are those of the inputs' `padding_mask`
    (T5: `encoder_padding_mask` / `decoder_padding_mask`); inputs without one count every
    row.

    Under `with kzoo.interpret.masked_heads(teacher, mask)` the student learns the masked
    teacher's maps (zeros for a removed head; the student runs unmasked): the distiller's
    compiled `fit` / `evaluate` / `predict` functions are traced again on entering and on
    leaving (`kzoo.layers.taps.RetracesUnderTaps`; on JAX and TensorFlow one traced before
    had kept the unmasked teacher inside, and one traced inside kept the mask after it).

    Args:
        student: the model to train (a kzoo task model).
        teacher: the model whose attention is imitated; set non-trainable here and run in
            inference mode, its maps under `stop_gradient`.
        attention_weight: weight of the attention KL in the loss, >= 0 (0: plain training,
            the KL still reported).
        layer_map, head_map, epsilon: see `AttentionDistillationLoss`.

    Example:
    >>> distiller = AttentionDistiller(student, teacher, attention_weight=1.0)
    >>> distiller.compile(optimizer=keras.optimizers.AdamW(1e-3))
    >>> history = distiller.fit(x, y, sample_weight=w, epochs=2)
    >>> history.history["attention_loss"]
    >>> kzoo.presets.save(distiller.student, "student")
    """

    def __init__(self, student, teacher, attention_weight=1.0, layer_map=None, head_map=None,
                 epsilon=1e-7, **kwargs):
        for name, model in (("student", student), ("teacher", teacher)):
            if not isinstance(model, keras.Model):
                raise ValueError(f"`{name}` must be a keras.Model; got "
                                 f"{name}={type(model).__name__}.")
        if student is teacher:
            raise ValueError("`student` and `teacher` must be two different models; got the "
                             "same object for both.")
        if not isinstance(attention_weight, numbers.Real) or isinstance(attention_weight, bool) \
                or not math.isfinite(float(attention_weight)) or attention_weight < 0:
            raise ValueError(f"`attention_weight` must be a finite number >= 0; got "
                             f"attention_weight={attention_weight!r}.")
        self.attention_loss_fn = AttentionDistillationLoss(layer_map, head_map, epsilon)
        student_layers, teacher_layers = attention_layers(student), attention_layers(teacher)
        kinds = [kind for kind in student_layers if kind in teacher_layers]
        if not kinds:
            raise ValueError(
                f"`student` and `teacher` have no kind of attention layer in common (student: "
                f"{sorted(student_layers) or 'none'}, teacher: {sorted(teacher_layers) or 'none'}).")
        for kind in kinds:  # validate the mappings now rather than in the first train step
            s_heads, t_heads = student_layers[kind], teacher_layers[kind]
            for i, j in self.attention_loss_fn.layer_pairs(len(s_heads), len(t_heads)):
                self.attention_loss_fn.head_groups(s_heads[i], t_heads[j])
        super().__init__(**kwargs)
        self.student = student
        self.teacher = teacher
        self.teacher.trainable = False
        self.attention_weight = float(attention_weight)
        self.layer_map = self.attention_loss_fn.layer_map
        self.head_map = self.attention_loss_fn.head_map
        self.epsilon = self.attention_loss_fn.epsilon
        self.kinds = kinds
        self.student_loss_tracker = keras.metrics.Mean(name="student_loss")
        self.attention_loss_tracker = keras.metrics.Mean(name="attention_loss")
        object.__setattr__(self, "_last_attention_loss", None)
        self.built = True

    def compile(self, optimizer="rmsprop", loss="auto", **kwargs):
        if isinstance(loss, str) and loss == "auto":
            default = getattr(self.student, "default_loss", None)
            loss = default() if default is not None else None
            if loss is None:
                raise ValueError(
                    f"The student ({type(self.student).__name__}) has no default loss; pass "
                    f"`loss` to compile; got loss='auto'.")
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def attention_maps(self, inputs, training=False):
        """`(student predictions, {kind: student maps}, {kind: teacher maps})` of one
        forward pass of each model (the maps `(batch, heads, query, key)`)."""
        teacher = getattr(self.teacher, "backbone", self.teacher)  # the maps are all there
        with Tap() as teacher_tap:
            teacher(inputs, training=False)
        with Tap() as student_tap:
            predictions = self.student(inputs, training=training)
        maps = []
        for tap in (student_tap, teacher_tap):
            groups = {}
            for record in tap.attention_records:
                groups.setdefault(_group_key(record.layer), []).append(record.weights)
            maps.append(groups)
        return predictions, maps[0], maps[1]

    def attention_loss(self, inputs, training=False):
        """The attention KL (unweighted) of the current weights on `inputs`, and the
        student's predictions: `(kl, predictions)`."""
        predictions, student_maps, teacher_maps = self.attention_maps(inputs, training)
        total = 0.0
        for kind in self.kinds:
            total = total + self.attention_loss_fn(
                student_maps[kind], [ops.stop_gradient(m) for m in teacher_maps[kind]],
                _query_mask(inputs, kind))
        return total / len(self.kinds), predictions

    def call(self, inputs, training=False):
        kl, predictions = self.attention_loss(inputs, training)
        # Consumed by `compute_loss` in the same train/test step (the same trace).
        object.__setattr__(self, "_last_attention_loss", kl)
        return predictions

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        student_loss = self._compile_loss(y, y_pred, sample_weight) \
            if self._compile_loss is not None else None
        if student_loss is None:
            raise ValueError("AttentionDistiller needs the student's loss: compile with "
                             "`loss` (or 'auto', the student's default loss).")
        kl = self._last_attention_loss
        if kl is None:
            kl, _ = self.attention_loss(x, training)
        object.__setattr__(self, "_last_attention_loss", None)
        student_loss = ops.cast(student_loss, "float32")
        self.student_loss_tracker.update_state(student_loss)
        self.attention_loss_tracker.update_state(kl)
        return student_loss + self.attention_weight * kl

    def get_config(self):
        return {
            "name": self.name,
            "student": keras.saving.serialize_keras_object(self.student),
            "teacher": keras.saving.serialize_keras_object(self.teacher),
            "attention_weight": self.attention_weight,
            "layer_map": self.layer_map,
            "head_map": self.head_map,
            "epsilon": self.epsilon,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key in ("student", "teacher"):
            config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(**config)


__all__ = ["AttentionDistillationLoss", "AttentionDistiller", "default_layer_map",
           "default_head_map"]
