"""Every Ray process of a run imports its heavy modules in its __init__, on one thread, before Ray
runs any call (docs/decisions.md, A fresh invocation reaches its cluster before its heavy imports):
a spare actor process that pre-samples once failed with `ImportError: cannot import name
'AutoModelForCausalLM' from 'transformers'`, its pre-sampling call
importing transformers while its `preload` call imported vLLM in another thread.

The heavy modules are stand-ins here (a seconds-long import of vLLM per try would make twenty tries
minutes): `lazypkg` fails a name that another thread is still importing, and the process's modules
that import transformers (actor_worker.py, presample.py, learner_worker.py, learner_trainer.py) are
shadowed by light ones that import `lazypkg`. The classes, the driver's functions and Ray's order of
calls (__init__ alone, then calls on up to `max_concurrency` threads) are the real ones. Each try is
a fresh process: a module is imported once per process.
"""

from __future__ import annotations

from conftest import run_child

# The stand-ins, written under the child's temporary directory.
LAZYPKG = {
    # A name's submodule imported on first use, as transformers' top-level module does; a name that
    # another thread is still importing fails, as transformers' did in the spare that pre-sampled.
    "__init__.py": '''
import importlib

_loading = set()

def __getattr__(name):
    if name != "AutoModel":
        raise AttributeError(name)
    if name in _loading:
        raise ImportError(f"cannot import name {name!r} from 'lazypkg' (another thread is importing it)")
    _loading.add(name)
    try:
        value = importlib.import_module("lazypkg.modeling").AutoModel
    finally:
        _loading.discard(name)
    globals()[name] = value
    return value
''',
    "modeling.py": "import time\ntime.sleep(0.2)\nAutoModel = object\n",
}
RUNTIME = {
    "actor_worker.py": '''
class _Engine:
    def reset(self, model_dir):
        pass

def vllm_engine():
    from lazypkg import AutoModel  # as vLLM imports transformers

def online_engine(cfg, model_dir, actor_id, version=0):
    vllm_engine()
    return _Engine()
''',
    "presample.py": '''
from lazypkg import AutoModel  # as presample.py imports transformers' AutoModelForCausalLM

def presample(cfg, model_dir, train, out_dir, engine=None):
    return None
''',
    "learner_worker.py": "",
    "learner_trainer.py": "from lazypkg import AutoModel\n",
}

CHILD = r'''
import json, os, sys, tempfile, types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dph_async.runtime
from dph_async.runtime import actor_process, learner_process
from dph_async.config import load_config

STUBS = json.loads(sys.argv[2])
root = Path(tempfile.mkdtemp())
for package, files in STUBS.items():
    (root / package).mkdir()
    for name, text in files.items():
        (root / package / name).write_text(text)
sys.path.insert(0, str(root))
dph_async.runtime.__path__.insert(0, str(root / "runtime"))  # the process's heavy modules: the light ones first
for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.muon",
             "deepspeed.runtime.zero.muon.muon_optimizer"):
    sys.modules[name] = types.ModuleType(name)


class Handle:
    """A Ray actor as Ray runs one: __init__ alone, then each call on one of `max_concurrency` threads."""

    def __init__(self, cls, options, args):
        self.obj = cls(*args)
        self.pool = ThreadPoolExecutor(options.get("max_concurrency", 1))
        self.calls = []

    def __getattr__(self, name):
        def remote(*args):
            self.calls.append(self.pool.submit(getattr(self.obj, name), *args))
        return types.SimpleNamespace(remote=remote)


class ActorClass:
    def __init__(self, cls):
        self.cls = cls

    def options(self, **options):
        return types.SimpleNamespace(remote=lambda *args: Handle(self.cls, options, args))


def fork(trial) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            trial()
            os._exit(0)
        except BaseException as e:
            Path(root / f"error{os.getpid()}").write_text(repr(e))
            os._exit(1)
    return pid


def spare_presamples():
    """The driver's calls to a spare that then pre-samples: `prestart_actors`, then `new_actor` takes
    the spare and calls `presample` on it."""
    actor_process.ActorProcess = ActorClass(actor_process.ActorProcess.__ray_actor_class__)
    actor_process.on_home_node = dict
    cfg = load_config("default", ["actors.num_actors=1"])
    actor_process.prestart_actors(cfg)
    actor = actor_process.new_actor(cfg, (0,), {})
    actor.presample.remote(cfg, str(root), str(root / "train.parquet"), str(root / "presample"))
    for call in actor.calls:
        call.result()


def imported_by_init(make):
    """Which of the stand-ins a process's __init__ imported."""
    def trial():
        make()
        names = ("dph_async.runtime.actor_worker", "dph_async.runtime.presample", "dph_async.runtime.learner_worker",
                 "dph_async.runtime.learner_trainer", "lazypkg.modeling")
        (root / f"imported{os.getpid()}").write_text(json.dumps([n for n in names if n in sys.modules]))
    return trial


out = {}
if sys.argv[3] == "race":
    pids = [fork(spare_presamples) for _ in range(int(sys.argv[4]))]
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    out = {"failed": sum(c != 0 for c in codes), "errors": sorted({f.read_text() for f in root.glob("error*")})}
else:
    cfg = load_config("default")
    classes = {
        "actor_vllm": lambda: actor_process.ActorProcess.__ray_actor_class__(0, 0.0, "vllm"),
        "actor_mixture": lambda: actor_process.ActorProcess.__ray_actor_class__(0, 0.0, "mixture"),
        "learner": lambda: learner_process.LearnerProcess.__ray_actor_class__(),
        "learner_rank": lambda: learner_process.LearnerRank.__ray_actor_class__(cfg, str(root), str(root), 1, ""),
    }
    for name, make in classes.items():
        pid = fork(imported_by_init(make))
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, (root / f"error{pid}").read_text()
        out[name] = json.loads((root / f"imported{pid}").read_text())
Path(sys.argv[1]).write_text(json.dumps(out))
'''


def _stubs() -> str:
    import json

    return json.dumps({"lazypkg": LAZYPKG, "runtime": RUNTIME})


def test_a_spare_that_pre_samples_at_once_never_meets_its_own_imports(tmp_path):
    """20 fresh processes, each a spare started with its cluster and then asked to pre-sample at once."""
    out = run_child(CHILD, tmp_path, _stubs(), "race", "20", timeout=120)
    assert out == {"failed": 0, "errors": []}


def test_every_ray_process_imports_what_its_calls_use_before_any_call(tmp_path):
    out = run_child(CHILD, tmp_path, _stubs(), "classes", timeout=120)
    assert out == {
        # vLLM and pre-sampling's modules with an online sampler's engine only
        "actor_vllm": ["dph_async.runtime.actor_worker", "dph_async.runtime.presample", "lazypkg.modeling"],
        "actor_mixture": ["dph_async.runtime.actor_worker"],
        "learner": ["dph_async.runtime.learner_worker", "dph_async.runtime.learner_trainer", "lazypkg.modeling"],
        "learner_rank": ["dph_async.runtime.learner_worker", "dph_async.runtime.learner_trainer", "lazypkg.modeling"],
    }
