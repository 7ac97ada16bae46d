"""The one list of model families.

Each family is registered once, in `_FAMILIES` below, as a `Family` record: its name, its
backbone class (and through it the config class), its task model classes, the task a preset
loads by default, the Hugging Face `model_type`s it reads and the module of its Hugging Face
converter (`kzoo/convert/<family>.py`, imported on first use). Its presets are the JSON files in
the top-level `presets/` directory whose `"family"` names it.

`kzoo.presets` and `kzoo.convert` read this module and never each other.

Example:
>>> from kzoo import registry
>>> gpt = registry.family("gpt")
>>> gpt.task_names
('backbone', 'causal_lm')
>>> registry.for_model_type("llama").name
'gpt'
>>> model = gpt.build(registry.preset_spec("gpt_mini")["config"])   # default task: causal_lm
>>> registry.for_model(model) is gpt
True
"""

import dataclasses
import difflib
import importlib
import inspect
import pathlib
import warnings
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType

from kzoo import checkpoints
from kzoo.models import bert, gpt, graphormer, t5, vit

BACKBONE_TASK = "backbone"  # the task name that builds the backbone alone
_RESERVED = ("name", "trainable", "dtype")  # Keras' own entries of get_config()
_PRESET_SUFFIX = ".json"


def _unknown(kind, value, known, label="Known"):
    # Compared without case and with "-" as "_" ("GPT_MINI", "bert-base-uncased" as the
    # hub spells it), then named as they are.
    def norm(text):
        return str(text).lower().replace("-", "_")

    spelled = {}
    for name in sorted(known):
        spelled.setdefault(norm(name), name)
    close = [spelled[n] for n in difflib.get_close_matches(norm(value), list(spelled), n=5,
                                                           cutoff=0.4)]
    hint = f" Did you mean {close}?" if close else ""
    return ValueError(f"Unknown {kind}={value!r}.{hint} {label}: {sorted(known)}.")


def check_model_dtype(dtype):
    """A model's `dtype`: a Keras dtype policy (or its name) computing in floating point,
    e.g. "float32", "bfloat16", "mixed_bfloat16"; anything else raises `ValueError` naming
    `dtype` (Keras' own errors for "float8" or "int32" come from deep inside the layers)."""
    import keras

    try:
        policy = keras.dtype_policies.get(dtype)
    except (ValueError, TypeError):
        policy = None
    compute = getattr(policy, "compute_dtype", None)
    variable = getattr(policy, "variable_dtype", None)
    if compute not in _FLOAT_DTYPES or variable not in _FLOAT_DTYPES:
        raise ValueError(
            "`dtype` must be a floating-point dtype policy: one of "
            f"{sorted(_FLOAT_DTYPES)}, 'mixed_float16', 'mixed_bfloat16' or a "
            f"`keras.DTypePolicy`; got dtype={dtype!r}."
        )
    mode = getattr(policy, "quantization_mode", None)
    if mode is not None and not isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        # (a quantized policy such as "int8_from_float32" built the model and then failed
        # in `quantize`: "no float Dense/Embedding layer left to quantize ... (already
        # quantized?)")
        raise ValueError(
            f"`dtype` must be a floating-point dtype policy; got dtype={dtype!r}, a "
            f"quantized one: build the model in {policy.compute_dtype} and call "
            f"`model.quantize({mode!r})`."
        )
    check_float64_available(policy, dtype)
    return dtype


def check_float64_available(policy, dtype):
    """Refuse a float64 `policy` (given as `dtype`) on JAX with 64-bit floats off (its
    default), where the model would silently hold float32 values."""
    import keras

    if "float64" not in (getattr(policy, "compute_dtype", None),
                         getattr(policy, "variable_dtype", None)):
        return
    if keras.config.backend() == "jax":
        import jax

        if not jax.config.jax_enable_x64:
            raise ValueError(
                f"dtype={getattr(dtype, 'name', dtype)!r} needs 64-bit floats, which JAX "
                "turns off by default: set "
                "the environment variable JAX_ENABLE_X64=1 (or call "
                "`jax.config.update('jax_enable_x64', True)`) before building the model.")


_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def warn_fresh_weights(checkpoint, names, task):
    """Warn that the weights `names` of a `task` model were not in `checkpoint` (a phrase:
    "The checkpoint", "The checkpoint '/path'"): loaded with another head than the one it
    was saved with, they keep their initial values, as transformers warns."""
    warnings.warn(
        f"{checkpoint} has no weights for {list(names)} of this {task!r} model (it was saved "
        "with another head): they keep a new model's initial values, and the outputs mean "
        "nothing until they are trained.", stacklevel=5)


@dataclasses.dataclass(frozen=True, eq=False)  # one record a family: identity is equality
class Family:
    """One model family.

    Attributes:
        name: the family name used in preset files and saved directories.
        backbone: the backbone class (a `keras.Model`; keyword arguments = config fields).
        tasks: task name -> task model class (`Cls(backbone=..., **task_config)`); the task
            "backbone" (the backbone alone) is always available besides these.
        default_task: the task `build` makes when none is given.
        model_types: the Hugging Face `model_type` values its converters read.
        converter: the module holding `config_from_hf`, `load_weights` and `to_hf`.
        converters: model_type -> module, for the model types another module than
            `converter` reads (BERT's "longformer": `kzoo.convert.longformer`). Such a module
            also defines `handles(model) -> bool`, True for the models it converts: those go
            to it in `load_hf_weights` and `to_hf`, every other model to `converter`.
    """

    name: str
    backbone: type
    tasks: Mapping[str, type]
    default_task: str
    model_types: tuple = ()
    converter: str | None = None
    converters: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "tasks", MappingProxyType(dict(self.tasks)))
        object.__setattr__(self, "model_types", tuple(self.model_types))
        object.__setattr__(self, "converters", MappingProxyType(dict(self.converters)))
        if not set(self.converters) <= set(self.model_types):
            raise ValueError(f"converters of {self.name} name model types it does not list.")
        # The classes say which family and task they are; the table must agree with them.
        if getattr(self.backbone, "family", None) != self.name:
            raise ValueError(f"{self.backbone.__name__}.family must be {self.name!r}.")
        for task, cls in self.tasks.items():
            if (cls.family, cls.task_name) != (self.name, task):
                raise ValueError(
                    f"{cls.__name__} must have family={self.name!r} and task_name={task!r}."
                )
        if self.default_task not in self.task_names:
            raise ValueError(f"default_task={self.default_task!r} is not a task of {self.name}.")

    # -- tasks and configs --------------------------------------------------------------------

    @property
    def task_names(self):
        """Every task this family builds, "backbone" first."""
        return (BACKBONE_TASK, *self.tasks)

    def task_class(self, task):
        """The class `build(..., task=task)` makes (the backbone class for "backbone")."""
        if task == BACKBONE_TASK:
            return self.backbone
        if task not in self.tasks:
            raise ValueError(
                f"`task` must be one of {sorted(self.task_names)} for family {self.name!r}; "
                f"got task={task!r}."
            )
        return self.tasks[task]

    @property
    def config_class(self):
        """The backbone's config dataclass, or None when the backbone declares none."""
        return getattr(self.backbone, "config_class", None)

    @property
    def config_fields(self):
        """Names of the backbone configuration (the dataclass fields, else the constructor's
        keyword arguments)."""
        if self.config_class is not None:
            return tuple(f.name for f in dataclasses.fields(self.config_class))
        return _keywords(self.backbone, exclude=("dtype",))

    def task_fields(self, task):
        """Names of the arguments of `task`'s model besides the backbone."""
        if task == BACKBONE_TASK:
            return ()
        return _keywords(self.task_class(task), exclude=("backbone", "dtype"))

    def split_overrides(self, task, overrides):
        """(config overrides, task overrides) of `overrides`; unknown names raise ValueError."""
        config_names, task_names = set(self.config_fields), set(self.task_fields(task))
        config, task_config = {}, {}
        for key, value in overrides.items():
            if key in config_names:
                config[key] = value
            elif key in task_names:
                task_config[key] = value
            else:
                allowed = sorted(config_names | task_names)
                close = difflib.get_close_matches(key, allowed, n=3)
                hint = f" Did you mean {close}?" if close else ""
                raise ValueError(
                    f"Unknown override {key}={value!r} for family {self.name!r}, task "
                    f"{task!r}.{hint} Allowed: {allowed}."
                )
        return config, task_config

    def build(self, config, task=None, task_config=None, dtype=None, source=None):
        """A new model (no trained weights) of this family from a backbone `config` dict.

        `source` (a file name) is named in the error when `config` has unknown fields.
        """
        task = self.default_task if task is None else task
        task_cls = self.task_class(task)
        unknown = sorted(set(config) - set(self.config_fields))
        if unknown:
            where = f" in {source!r}" if source else ""
            raise ValueError(
                f"Unknown {self.name} config field(s) {unknown}{where}. Allowed: "
                f"{sorted(self.config_fields)}."
            )
        dtype_kwargs = {} if dtype is None else {"dtype": check_model_dtype(dtype)}
        backbone = self.backbone(**config, **dtype_kwargs)
        if task == BACKBONE_TASK:
            return backbone
        return task_cls(backbone=backbone, **(task_config or {}), **dtype_kwargs)

    def task_of(self, model):
        """The task name of `model`, a backbone or task model of this family."""
        if isinstance(model, self.backbone):
            return BACKBONE_TASK
        for task, cls in self.tasks.items():
            if isinstance(model, cls):
                return task
        raise ValueError(f"`model` is not a {self.name} model; got {type(model).__name__}.")

    def describe(self, model):
        """(task, backbone config, task config) of `model`: what `build` needs to remake it."""
        task = self.task_of(model)
        backbone = model if task == BACKBONE_TASK else model.backbone
        config = {k: v for k, v in backbone.get_config().items() if k not in _RESERVED}
        task_config = {}
        if task != BACKBONE_TASK:
            task_config = {k: v for k, v in model.get_config().items()
                           if k not in _RESERVED and k != "backbone"}
        return task, config, task_config

    @property
    def presets(self):
        """Names of the presets of this family."""
        return tuple(n for n in preset_names() if preset_spec(n)["family"] == self.name)

    # -- Hugging Face import / export ---------------------------------------------------------

    def _converter_module(self, model_type=None):
        if model_type in self.converters:
            return importlib.import_module(self.converters[model_type])
        if self.converter is None:
            raise ValueError(
                f"No Hugging Face converter for family={self.name!r}; families with one: "
                f"{sorted(f.name for f in _FAMILIES if f.converter)}."
            )
        return importlib.import_module(self.converter)

    def _converter_for(self, model):
        """The converter module of `model`: the first of `converters` that handles it, else
        `converter`."""
        for module_name in self.converters.values():
            module = importlib.import_module(module_name)
            if module.handles(model):
                return module
        return self._converter_module()

    def config_from_hf(self, hf_config, **kwargs):
        """(family, backbone config, task, task config) for a Hugging Face config dict
        (`kwargs` go to the `config_from_hf` of its model_type's converter)."""
        return self._converter_module(hf_config.get("model_type")).config_from_hf(
            hf_config, **kwargs)

    def load_hf_weights(self, model, state, strict=True):
        """Assign a Hugging Face state dict (name -> array) to `model`; with `strict`, a
        missing or left-over tensor raises ValueError."""
        module = self._converter_for(model)
        reader = checkpoints.WeightReader(state, ignore=getattr(module, "IGNORED_WEIGHTS", ()))
        module.load_weights(model, reader)
        if strict:
            reader.finish()
        elif reader.missing:
            # Another head than the checkpoint's (e.g. a `LlamaModel` or `BertModel` loaded as
            # a language model): its weights are fresh, random ones. transformers warns of
            # them by name; kzoo ran `generate` on a random head in silence.
            warn_fresh_weights("The checkpoint", reader.missing, self.task_of(model))

    def to_hf(self, model):
        """(Hugging Face config dict, state dict) of `model`."""
        return self._converter_for(model).to_hf(model)


def _keywords(cls, exclude):
    params = inspect.signature(cls.__init__).parameters.values()
    return tuple(p.name for p in params
                 if p.name != "self" and p.name not in exclude
                 and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


_FAMILIES = (
    Family(
        "bert", bert.BertBackbone,
        tasks={"masked_lm": bert.BertMaskedLM, "classifier": bert.BertClassifier},
        default_task="masked_lm", model_types=("bert", "longformer"),
        converter="kzoo.convert.bert",
        # Hugging Face Longformer: BERT with attention="longformer" and global projections.
        converters={"longformer": "kzoo.convert.longformer"},
    ),
    Family(
        "gpt", gpt.GPTBackbone,
        tasks={"causal_lm": gpt.GPTCausalLM},
        default_task="causal_lm",
        # GPT-2, and the modern configuration (RMSNorm, RoPE, SwiGLU, GQA; Mixtral: with MoE).
        model_types=("gpt2", "llama", "mixtral", "mistral"), converter="kzoo.convert.gpt",
    ),
    Family(
        "t5", t5.T5Backbone,
        tasks={"seq2seq_lm": t5.T5Seq2SeqLM},
        default_task="seq2seq_lm", model_types=("t5",), converter="kzoo.convert.t5",
    ),
    Family(
        "vit", vit.ViTBackbone,
        tasks={"classifier": vit.ViTClassifier},
        default_task="classifier", model_types=("vit",), converter="kzoo.convert.vit",
    ),
    Family(
        "graphormer", graphormer.GraphormerBackbone,
        tasks={"predictor": graphormer.GraphormerPredictor},
        default_task="predictor", model_types=("graphormer",),
        converter="kzoo.convert.graphormer",
    ),
)
_BY_NAME = {f.name: f for f in _FAMILIES}
_BY_MODEL_TYPE = {t: f for f in _FAMILIES for t in f.model_types}
assert len(_BY_NAME) == len(_FAMILIES), "two families share a name"
assert len(_BY_MODEL_TYPE) == sum(len(f.model_types) for f in _FAMILIES), \
    "two families read the same model_type"


KERAS_HUB_CONVERTER = "kzoo.convert.keras_hub"


def keras_hub_converter():
    """The module that reads and writes keras-hub preset directories
    (`kzoo.convert.keras_hub`: BERT, GPT-2 and ViT)."""
    return importlib.import_module(KERAS_HUB_CONVERTER)


def families():
    """Every registered `Family`, in registration order."""
    return _FAMILIES


def family(name):
    """The `Family` called `name`; ValueError listing the known names otherwise."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise _unknown("family", name, _BY_NAME, "Known families")
    return _BY_NAME[name]


def for_model_type(model_type):
    """The `Family` that reads Hugging Face checkpoints of `model_type`."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"Unsupported Hugging Face model_type={model_type!r}. Supported: "
            f"{sorted(_BY_MODEL_TYPE)}."
        )
    return _BY_MODEL_TYPE[model_type]


def for_model(model):
    """The `Family` of a kzoo backbone or task model."""
    for fam in _FAMILIES:
        if isinstance(model, (fam.backbone, *fam.tasks.values())):
            return fam
    raise ValueError(
        f"`model` must be a backbone or task model of a kzoo family {sorted(_BY_NAME)}; got "
        f"{type(model).__name__}."
    )


# -- presets ------------------------------------------------------------------------------------


def preset_dir():
    """The directory of the preset JSON files: `kzoo/preset_files` in an installed package (the
    wheel maps the top-level `presets/` there, see pyproject.toml), else the top-level `presets/`
    of the source checkout that holds this `kzoo`."""
    packaged = resources.files("kzoo").joinpath("preset_files")
    if packaged.is_dir():
        return packaged
    return pathlib.Path(__file__).resolve().parent.parent / "presets"


def preset_names():
    """Sorted names of the presets that ship with kzoo."""
    return sorted(p.name[: -len(_PRESET_SUFFIX)] for p in preset_dir().iterdir()
                  if p.name.endswith(_PRESET_SUFFIX))


def preset_spec(name):
    """The JSON description of preset `name` (a new dict each call), checked: its family is
    registered, `config` and `task_config` are objects and its task is one of the family's."""
    if not isinstance(name, str) or any(c in name for c in "/\\:") or name.startswith("."):
        raise ValueError(
            f"`name` must be a preset name (no path separators or ':', not starting with '.'); got "
            f"name={name!r}. Known presets: {preset_names()}."
        )
    names = preset_names()
    if name not in names:
        raise _unknown("preset name", name, names, "Known presets")
    entry = preset_dir().joinpath(name + _PRESET_SUFFIX)
    spec = checkpoints.parse_json(entry.read_bytes(), str(entry), "preset file")
    check_spec(spec, f"the preset file {str(entry)!r}")
    return spec


def check_spec(spec, source):
    """The `Family` of `spec`, a model description as preset files and saved directories hold
    it (`family`, `task`, `config`, `task_config`), after checking it; errors name `source`."""
    try:
        fam = family(spec.get("family"))
        fam.task_class(spec.get("task", fam.default_task))
    except ValueError as e:
        raise ValueError(f"In {source}: {e}") from None
    for key in ("config", "task_config"):
        value = spec.get(key, {} if key == "task_config" else None)
        if not isinstance(value, dict):
            raise ValueError(f"In {source}: `{key}` must be a JSON object; got {value!r}.")
    return fam


__all__ = ["Family", "BACKBONE_TASK", "KERAS_HUB_CONVERTER", "keras_hub_converter", "families",
           "family", "for_model_type", "for_model", "preset_dir", "preset_names", "preset_spec",
           "check_spec"]
