"""`import kzoo`: every public submodule is there, and no foreign framework is imported.

Each check runs in a fresh interpreter (`sys.modules` of the test process already holds
whatever other tests imported), on the current backend. Frameworks are compared with what
`import keras` alone imports on that backend: Keras 3.15 itself imports jax (its Orbax
checkpoint callback) and scikit-learn (its wrappers) whenever they are installed, which is
not kzoo's doing; TensorFlow, on the JAX and torch backends, kzoo keeps out (see
`kzoo._lazy_tensorflow`).
"""

import json
import os
import pkgutil
import subprocess
import sys

import keras

import kzoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("tensorflow", "torch", "jax")

PROBE = r"""
import json, os, sys
import keras
with_keras = set(sys.modules)
import kzoo
after_import = set(sys.modules)
model = kzoo.presets.load("gpt_mini", num_layers=1)
keras.utils.set_random_seed(0)
model.save(os.path.join(sys.argv[1], "m.keras"))
kzoo.presets.save(model, os.path.join(sys.argv[1], "preset"))
after_use = set(sys.modules)
top = lambda names: sorted({n.split(".")[0] for n in names})
print(json.dumps({"keras": top(with_keras), "import": top(after_import),
                  "use": top(after_use), "submodules": list(kzoo.SUBMODULES),
                  "attributes": [n for n in kzoo.SUBMODULES
                                 if type(getattr(kzoo, n, None)).__name__ == "module"]}))
"""


def _probe(tmp_path):
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def test_every_public_submodule_is_listed_and_imported():
    package_dir = os.path.dirname(kzoo.__file__)
    public = sorted(m.name for m in pkgutil.iter_modules([package_dir])
                    if not m.name.startswith("_"))
    assert public, package_dir
    assert sorted(kzoo.SUBMODULES) == public, (
        "kzoo/__init__.py must import (and list in SUBMODULES) every public submodule")
    for name in public:
        assert getattr(kzoo, name).__name__ == f"kzoo.{name}"


def test_import_and_use_bring_no_foreign_framework(tmp_path):
    record = _probe(tmp_path)
    backend = keras.backend.backend()
    assert record["attributes"] == record["submodules"]
    foreign = [f for f in FRAMEWORKS if f != backend]
    # kzoo imports no framework that `import keras` did not already import...
    for stage in ("import", "use"):
        added = [f for f in foreign if f in record[stage] and f not in record["keras"]]
        assert not added, f"{stage} of kzoo imported {added} on the {backend} backend"
    # ...and TensorFlow stays out on the other backends even through Keras' serialization
    # and seeding, which import it when asked whether it is available.
    if backend != "tensorflow":
        assert "tensorflow" not in record["use"], record["use"]
