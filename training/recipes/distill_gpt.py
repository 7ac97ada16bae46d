"""`distill_gpt`: distil a larger GPT's attention into a smaller one, and measure what it buys.

1. The teacher: the demo's GPT (4 blocks of width 128, 4 heads, `--override` to change) is
   trained on the prose of the standard library's `pydoc_data.topics` (BPE of 1024 tokens
   trained on the training 90%, as `demo`), for `--teacher-steps` steps, with the usual
   outputs and checkpoints in `<out>/teacher/` (a second run re-uses it); or it is loaded
   from `--teacher DIR` (a saved preset directory such as `runs/demo/model`, which must use
   the same tokenizer: same text options).
2. Two students of the same smaller shape (`--student-layers`, `--student-hidden-dim`,
   `--student-heads`), each initialised from the same seed and trained `--steps` steps on
   the same batches with `kzoo.interpret.AttentionDistiller`: once with
   `attention_weight=0` (plain next-token training; the attention KL is only measured) and
   once with `--attention-weight` (next-token loss + weight x KL(teacher || student) of the
   attention maps; student layer i learns from teacher layer round((i+1) Lt/Ls) - 1, each
   student head from the mean of its group of teacher heads).
3. A table of the validation next-token loss and perplexity on the held-out 10% of the
   text, and of the attention KL to the teacher, for the teacher and both students. The
   students are saved to `<out>/student_plain/` and `<out>/student_attention/`
   (`kzoo.presets.load`), the figures to `<out>/metrics.json`.

Small settings for a quick check: `--teacher-steps 2 --steps 2 --seq-len 32 --max-chars
50000 --override num_layers=2 --override hidden_dim=32 ...` (see tests/test_distill.py).
"""

import dataclasses
import json
import math
import os

import keras

import kzoo.presets
from training.loop import make_optimizer, set_seed
from training.recipes import _text
from training.recipes import demo
from training.recipes import gpt_text

NAME = "distill_gpt"
HELP = ("distil a GPT teacher trained on the pydoc prose into a smaller student, with and "
        "without the attention KL term; prints their validation losses.")
DEFAULTS = dict(
    demo.DEFAULTS,
    steps=300,            # steps of each student
)
OPTION_DEFAULTS = dict(tokenizer="bpe", bpe_vocab=1024, seq_len=128, prose_only=True)
TEXT_OPTIONS = ("text", "tokenizer", "bpe_vocab", "seq_len", "max_chars", "prose_only")


def add_arguments(parser):
    _text.add_text_arguments(parser, seq_len=128)
    parser.set_defaults(**OPTION_DEFAULTS)
    parser.add_argument("--teacher", default=None, metavar="DIR",
                        help="a saved GPT preset directory to use as the teacher instead of "
                             "training one (e.g. runs/demo/model)")
    parser.add_argument("--teacher-steps", type=int, default=300,
                        help="steps to train the teacher for (default 300)")
    parser.add_argument("--student-layers", type=int, default=2,
                        help="blocks of the students (default 2)")
    parser.add_argument("--student-hidden-dim", type=int, default=64,
                        help="width of the students (default 64)")
    parser.add_argument("--student-heads", type=int, default=2,
                        help="attention heads of the students (default 2)")
    parser.add_argument("--attention-weight", type=float, default=1.0,
                        help="weight of the attention KL for the distilled student "
                             "(default 1.0)")


def check_options(options):
    _text.check_options(options)
    for key, least in (("teacher_steps", 1), ("student_layers", 1), ("student_hidden_dim", 1),
                       ("student_heads", 1)):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"--{key.replace('_', '-')} must be an integer >= {least}; "
                             f"got {value!r}.")
    weight = options.get("attention_weight")
    if weight is not None and (not math.isfinite(weight) or weight <= 0):
        raise ValueError(f"--attention-weight must be a finite number > 0 (the plain student "
                         f"is the weight-0 run); got {weight!r}.")
    width, heads = options.get("student_hidden_dim"), options.get("student_heads")
    if width and heads and width % heads:
        raise ValueError(f"--student-heads must divide --student-hidden-dim; got "
                         f"{heads} and {width}.")
    if options.get("teacher") is not None and not os.path.isdir(options["teacher"]):
        raise ValueError(f"--teacher must be a saved preset directory; got "
                         f"{options['teacher']!r}.")


def build_task(cfg):
    """(tokenizer, task): the text windows of `gpt_text`, validation on the held-out text."""
    tokenizer, _, task = gpt_text.text_task(cfg)
    return tokenizer, task


def _same_tokenizer(directory, tokenizer):
    """Whether the tokenizer saved next to a model in `directory` is `tokenizer`."""
    saved = os.path.join(directory, "tokenizer.json")
    if tokenizer.kind == "bpe":
        if not os.path.exists(saved):
            return False
        with open(saved) as f:
            return json.loads(f.read()) == json.loads(tokenizer.tokenizer.to_str())
    return not os.path.exists(saved)


def teacher_model(cfg, tokenizer, task):
    """The teacher: loaded from `--teacher`, or trained (and checkpointed) in
    `<out>/teacher` with the harness of every recipe. Returns `(model, directory)`."""
    seq_len = int(cfg.options.get("seq_len", 128))
    directory = cfg.options.get("teacher")
    if directory is not None:
        teacher = kzoo.presets.load(directory)
        vocab = getattr(teacher.backbone, "vocabulary_size", None)
        if vocab != tokenizer.vocabulary_size or not _same_tokenizer(directory, tokenizer):
            raise ValueError(
                f"--teacher {directory!r} was trained with another tokenizer (vocabulary "
                f"{vocab}, this run's {tokenizer.vocabulary_size}); use the text options it "
                f"was trained with (e.g. demo's: --tokenizer bpe --bpe-vocab 1024).")
        if teacher.backbone.max_sequence_length < seq_len:
            raise ValueError(f"--seq-len {seq_len} is longer than the teacher's "
                             f"{teacher.backbone.max_sequence_length} positions.")
        return teacher, directory
    from training.loop import run
    from training.losses import SmoothedSparseCrossentropy

    teacher_cfg = dataclasses.replace(
        cfg, out=os.path.join(cfg.out, "teacher"), steps=int(cfg.options["teacher_steps"]),
        epochs=None, options={k: cfg.options.get(k) for k in TEXT_OPTIONS})
    set_seed(cfg.seed)
    overrides = _text.model_overrides(teacher_cfg, tokenizer, seq_len)
    teacher = kzoo.presets.load(cfg.preset, dtype=cfg.dtype, **overrides)
    task.steps_per_epoch = max(task.steps_per_epoch, teacher_cfg.steps)  # one progress bar
    if cfg.verbose:
        print(f"Teacher: {_shape(teacher)}, {teacher_cfg.steps} steps", flush=True)
    record = run(teacher_cfg, teacher, task,
                 loss=SmoothedSparseCrossentropy(cfg.label_smoothing),
                 metrics=gpt_text.lm_metrics(), monitor="val_loss", mode="min",
                 extra_files=[lambda d: tokenizer.save(d)])
    return teacher, os.path.dirname(record["files"]["model"])


def _shape(model):
    b = model.backbone
    return f"{b.num_layers} x {b.hidden_dim} x {b.num_heads} heads"


def train_student(cfg, tokenizer, task, teacher, attention_weight):
    """A student trained `cfg.steps` steps from the run's seed with `attention_weight`;
    returns `(student, distiller)`."""
    from kzoo.interpret import AttentionDistiller

    seq_len = int(cfg.options.get("seq_len", 128))
    width = int(cfg.options.get("student_hidden_dim", 64))
    student_cfg = dataclasses.replace(cfg, overrides=dict(
        cfg.overrides, num_layers=int(cfg.options.get("student_layers", 2)),
        hidden_dim=width, intermediate_dim=4 * width,
        num_heads=int(cfg.options.get("student_heads", 2))))
    preset = cfg.preset if not os.path.isdir(cfg.preset) else "gpt_mini"
    student_cfg = dataclasses.replace(student_cfg, preset=preset)
    set_seed(cfg.seed)
    student = kzoo.presets.load(preset, dtype=cfg.dtype,
                                **_text.model_overrides(student_cfg, tokenizer, seq_len))
    distiller = AttentionDistiller(student, teacher, attention_weight=attention_weight)
    distiller.compile(optimizer=make_optimizer(cfg))
    x, y, w = task.segment(0, int(cfg.steps))
    distiller.fit(x, y, sample_weight=w, batch_size=task.batch_size, epochs=1, shuffle=False,
                  verbose=cfg.verbose)
    return student, distiller


def validation(model, task, distiller=None):
    """Validation loss / accuracy / perplexity of a causal LM (and, with a distiller, the
    attention KL of its student to its teacher) on the held-out windows."""
    model.compile(loss="auto", weighted_metrics=gpt_text.lm_metrics())
    out = gpt_text.validation_metrics(model, task)
    out["params"] = int(model.count_params())
    out["shape"] = _shape(model)
    if distiller is not None:
        x, y, w = task.validation
        results = distiller.evaluate(x, y, sample_weight=w, batch_size=task.batch_size,
                                     verbose=0, return_dict=True)
        out["val_attention_kl"] = float(results["attention_loss"])
    return out


def table(rows):
    """The printed comparison: one line per `(name, metrics)`."""
    lines = [f"{'model':<32} {'shape':<22} {'params':>9} {'val loss':>9} {'perplexity':>10} "
             f"{'attention KL':>13}"]
    for name, m in rows:
        kl = m.get("val_attention_kl")
        lines.append(f"{name:<32} {m['shape']:<22} {m['params']:>9,} {m['val_loss']:>9.4f} "
                     f"{m['val_perplexity']:>10.2f} "
                     f"{'-' if kl is None else format(kl, '.4f'):>13}")
    return "\n".join(lines)


def train(cfg):
    from training.loop import total_steps

    check_options(cfg.options)
    os.makedirs(cfg.out, exist_ok=True)
    tokenizer, task = build_task(cfg)
    cfg = dataclasses.replace(cfg, steps=total_steps(cfg, task), epochs=None)
    teacher, teacher_dir = teacher_model(cfg, tokenizer, task)
    teacher_metrics = validation(teacher, task)
    weight = float(cfg.options.get("attention_weight", 1.0))
    rows = [("teacher", teacher_metrics)]
    files = {"teacher": os.path.abspath(teacher_dir)}
    for key, w in (("plain", 0.0), ("attention", weight)):
        if cfg.verbose:
            print(f"Student ({key}): attention_weight={w:g}, {cfg.steps} steps", flush=True)
        student, distiller = train_student(cfg, tokenizer, task, teacher, w)
        rows.append((f"student, attention_weight={w:g}", validation(student, task, distiller)))
        directory = os.path.join(cfg.out, f"student_{key}")
        kzoo.presets.save(student, directory)
        tokenizer.save(directory)
        files[f"student_{key}"] = os.path.abspath(directory)
    record = {
        "metrics": {name: m for name, m in rows},
        "run": {"recipe": cfg.recipe, "backend": keras.backend.backend(), "seed": cfg.seed,
                "student_steps": cfg.steps, "teacher_steps": cfg.options.get("teacher_steps")
                if cfg.options.get("teacher") is None else None,
                "batch_size": cfg.batch_size, "options": cfg.options, "data": task.info},
        "files": files,
    }
    with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
        json.dump(record, f, indent=2, default=str)
        f.write("\n")
    print(f"Validation on the held-out {task.info['text']} text "
          f"({len(task.validation[1])} windows of {cfg.options.get('seq_len', 128)} "
          f"{task.info['tokenizer']} tokens); students: {cfg.steps} steps each, seed "
          f"{cfg.seed}, the same batches:")
    print(table(rows))
    print(f"Students saved in {files['student_plain']} and {files['student_attention']}.")
    return record
