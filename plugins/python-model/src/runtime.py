"""trainerd's side of a Python model file, run inside the python-model plugin's interpreter.

The plugin (Rust) calls `info`, `Runner`, `Runner.step` and `Runner.predict`; everything that
reads the user's file, calls it, and checks what it returned is here. Every problem is raised as
`ModelFileError` with a message that names the file; an exception in the user's code says its
type, its message and the file and line of the user's frame.

The file's contract (see the plugin's README section):
    arguments = {"key": "default", ...}       optional: the --plugin-arg keys it accepts
    columns = {"input_ids": "tokens:128"}     what it reads of a Parquet dataset ("text:128":
                                              raw text, tokenized and packed into blocks); or
    def columns(args) -> dict                 the same from the arguments (a length by flag)
    def model(args) -> torch.nn.Module        required; or a compiled keras.Model (Keras 3, its torch
                                              backend): its compile() names the loss, metrics and
                                              optimizer (keras_model.py), and loss/metrics/predict
                                              below are not used
    def loss(module, batch) -> Tensor         optional: the batch's mean loss, a 0-dim tensor, or
                                              (loss, outputs) to hand the outputs to metrics
    def metrics(module, batch[, outputs])     optional: a dict of sums over the batch's examples
    def predict(module, batch) -> Tensor      optional: outputs per example
    language_model = True                     optional: the epoch line shows perplexity
    no_decay = ["bias", "norm"]               optional: AdamW leaves undecayed each parameter whose
                                              named_parameters() name contains one of these
                                              (default: those of fewer than 2 dimensions)
"""

import ast
import hashlib
import importlib.metadata
import importlib.util
import inspect
import math
import os
import sys
import traceback

import torch
import torch.nn.functional as F

import trainerd_keras_runtime as keras_model

LABEL = "label"
ATTENTION_MASK = "attention_mask"
# What a file that declares no columns trains on: the MNIST-format data's.
MNIST_COLUMNS = {"image": "image:1x28x28", LABEL: "integer"}


class ModelFileError(Exception):
    """A problem with the model file, its message complete."""


_loaded = {}


def _where(path, exc):
    """`FILE:LINE` of the user's innermost frame in `exc`'s traceback (else the innermost)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) == path]
    frame = (mine or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else path


def _raised(path, what, exc):
    """The error for exception `exc` raised while doing `what` with the file at `path`."""
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    text = f"model file {path}: {what} raised {type(exc).__name__}: {message} ({_where(path, exc)})"
    return ModelFileError(text)


def load(path):
    """The model file at `path` as a module, loaded once per process."""
    path = os.path.abspath(path)
    if path in _loaded:
        return _loaded[path]
    if not os.path.exists(path):
        raise ModelFileError(
            f"model file {path} does not exist (--plugin-arg module=PATH names a Python file that defines "
            f"model(args) -> torch.nn.Module)"
        )
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path} is not a file: expected a Python file defining model(args)")
    with open(path, "rb") as f:
        source = f.read()
    try:
        text = source.decode("utf-8")
        if "\0" in text:
            raise UnicodeDecodeError("utf-8", source, 0, 1, "a NUL byte")
    except UnicodeDecodeError:
        raise ModelFileError(
            f"model file {path} is not Python: it is not UTF-8 text (a TorchScript archive goes to the "
            f"torchscript plugin; this one takes a .py file defining model(args))"
        ) from None
    try:
        code = compile(text, path, "exec")
    except SyntaxError as e:
        raise ModelFileError(f"model file {path} is not valid Python: {type(e).__name__}: {e.msg} ({path}:{e.lineno})")
    # Its folder last on the path: modules beside it import, and none of them shadows the
    # standard library's (an examples folder may hold a tokenize.py).
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.append(folder)
    # A Keras 3 model runs on Keras's torch backend: set before the file imports keras.
    os.environ["KERAS_BACKEND"] = "torch"
    name = "trainerd_model_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException as e:  # noqa: BLE001 - SystemExit in a user's file is an error too
        del sys.modules[name]
        backend = os.environ.get("KERAS_BACKEND", "torch")
        if backend != "torch":
            # The file chose another Keras backend, whose import failed.
            raise ModelFileError(
                f"model file {path}: {keras_model.backend_refusal(backend)} (importing it raised "
                f"{type(e).__name__}: {e})"
            ) from None
        raise _raised(path, "importing it", e) from None
    module.__trainerd_source__ = source
    _loaded[path] = module
    return module


def _returns(node):
    """The return statements of function `node`, not those of functions, lambdas or classes
    nested in it."""
    found, todo = [], list(node.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Return):
            found.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))
    return found


def _metric_names(path, module, fn):
    """The keys of the dict literal(s) that `metrics` returns, read from the file's source."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    node = None
    if code is not None and os.path.abspath(code.co_filename) == path:
        tree = ast.parse(module.__trainerd_source__)
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn.__name__:
                lines = [n.lineno] + [d.lineno for d in n.decorator_list]
                if code.co_firstlineno in lines:
                    node = n
                    break
    found = []
    for r in _returns(node) if node else []:
        if not isinstance(r.value, ast.Dict) or not all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in r.value.keys
        ):
            found = None
            break
        found.append([k.value for k in r.value.keys])
    if not found or any(f != found[0] for f in found):
        raise ModelFileError(
            f"model file {path}: metrics must return a dict literal with the same string keys on every return "
            f"(such as return {{\"accuracy\": correct}}), or the file must name them: metric_names = [...]"
        )
    return found[0]


def _metrics_of(path, module):
    """The names of the metrics the file reports, in order."""
    metrics_fn = getattr(module, "metrics", None)
    if metrics_fn is None:
        return [] if getattr(module, "loss", None) is not None else ["accuracy"]
    names = getattr(module, "metric_names", None)
    return [str(n) for n in names] if names is not None else _metric_names(path, module, metrics_fn)


def _imported_distributions(path, source):
    """{distribution: version} of the installed distributions the file imports at top level."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    tops = set()
    for node in tree.body:
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                tops.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                tops.add(n.module.split(".")[0])
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                break
    dists = importlib.metadata.packages_distributions()
    out = {}
    for top in sorted(tops):
        for dist in dists.get(top, []):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return out


def _arguments(path, module, given):
    """The file's arguments: its declared defaults with the given values over them; a key it does
    not declare is refused, listing those it does."""
    declared = getattr(module, "arguments", {})
    if not isinstance(declared, dict):
        raise ModelFileError(
            f"model file {path}: arguments is {type(declared).__name__}, expected a dict of key to default"
        )
    declared = {str(k): (None if v is None else str(v)) for k, v in declared.items()}
    for key in given:
        if key not in declared:
            accepted = ", ".join(["module"] + sorted(declared))
            raise ModelFileError(f"--plugin-arg {key}: no such key in model file {path}; it accepts {accepted}")
    args = dict(declared)
    args.update(given)
    missing = [k for k, v in args.items() if v is None]
    if missing:
        raise ModelFileError(f"model file {path} requires --plugin-arg {missing[0]}=VALUE (it has no default)")
    return args


def _columns(path, module, args):
    """The columns the file declares (a dict of name to kind), or None."""
    columns = getattr(module, "columns", None)
    if callable(columns):
        try:
            columns = columns(dict(args))
        except Exception as e:  # noqa: BLE001
            raise _raised(path, "columns(args)", e) from None
    if columns is not None and not (isinstance(columns, dict) and all(isinstance(k, str) for k in columns)):
        raise ModelFileError(
            f"model file {path}: columns is {type(columns).__name__}, expected a dict of column name to kind, "
            f"such as {{\"input_ids\": \"tokens:128\"}}"
        )
    return columns


def _build(path, module, args, device, columns):
    """The file's model(args) on `device`, and its `KerasModel` when it is a compiled Keras model
    (None for a torch.nn.Module): built with Keras prepared (names, seed, device) when the file
    uses Keras."""
    try:
        with keras_model.building(module.__trainerd_source__, device, torch.initial_seed()):
            net = module.model(dict(args))
    except keras_model.Refused as e:
        raise ModelFileError(f"model file {path}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise _raised(path, "model(args)", e) from None
    if not keras_model.is_model(net):
        return net, None
    try:
        return net, keras_model.KerasModel(net, columns or MNIST_COLUMNS, device)
    except keras_model.Refused as e:
        raise ModelFileError(f"model file {path}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise _raised(path, "building the Keras model", e) from None


def info(path, given):
    """What the plugin's info says of the file: a dict of plain values."""
    module = load(path)
    path = os.path.abspath(path)
    args = _arguments(path, module, given)
    if not callable(getattr(module, "model", None)):
        raise ModelFileError(
            f"model file {path} defines no model function: expected def model(args) -> torch.nn.Module"
        )
    columns = _columns(path, module, args)
    keras = None
    if keras_model.imported(module.__trainerd_source__) is not None:
        # A Keras model is built for real (on the CPU): what compile() said is read from it.
        _, keras = _build(path, module, args, "cpu", columns)
        if keras is not None and columns is None:
            # It trains on MNIST-format data as Parquet too (`trainerd data convert`'s columns).
            columns = dict(MNIST_COLUMNS)
    no_decay = getattr(module, "no_decay", [])
    if not (isinstance(no_decay, (list, tuple)) and all(isinstance(n, str) and n for n in no_decay)):
        raise ModelFileError(
            f"model file {path}: no_decay is {no_decay!r}, expected a list of name parts such as [\"bias\", \"norm\"] "
            f"(AdamW leaves undecayed each parameter whose name contains one)"
        )
    names = keras.metric_names() if keras is not None else _metrics_of(path, module)
    source = module.__trainerd_source__
    identity = {"module_sha256": hashlib.sha256(source).hexdigest(), "torch": torch.__version__}
    packages = _imported_distributions(path, source)
    packages.pop("torch", None)
    identity.update({f"package {d}": v for d, v in packages.items()})
    identity.update({f"arg {k}": v for k, v in sorted(args.items())})
    identity.update(keras_model.identity() if keras is not None else {})
    doc = (module.__doc__ or "").strip().splitlines()
    if keras is not None:
        # Each variable under its path (`sequential/conv2d/kernel`), the name the export keeps.
        facts = {"export_names": [[v.path, v.path] for v in keras.variables], "vocab_size": None,
                 "optimizer": keras.optimizer}
    else:
        facts = _meta_facts(path, module, args)
    return {
        "description": doc[0] if doc else f"model(args) of {os.path.basename(path)}",
        "columns": None if columns is None else [[k, str(v)] for k, v in columns.items()],
        "metrics": names,
        "identity": identity,
        "language_model": bool(getattr(module, "language_model", False)),
        **facts,
        "no_decay": list(no_decay),
    }


def _positional(fn):
    """How many positional parameters `fn` takes."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return 3
    return sum(1 for p in params if p.kind in kinds)


def _variables(net):
    """A module's variables as trainerd holds them: its parameters (a shared one once) and its
    persistent buffers, each under its state_dict name."""
    persistent = set(net.state_dict().keys())
    return list(net.named_parameters()) + [(n, b) for n, b in net.named_buffers() if n in persistent]


def _meta_facts(path, module, args):
    """What the module built on the meta device (no memory, no generator) tells: `export_names`,
    [state_dict key, variable name] of every key (what `trainerd ckpt export` names the tensors,
    so that load_state_dict takes the export as it is, tied weights under each of their keys),
    and `vocab_size`, the rows of its token embedding (a Hugging Face model's input embeddings,
    else its first nn.Embedding), which a tokenizer's ids must stay below. Empty when the module
    does not build there."""
    try:
        with torch.device("meta"):
            net = module.model(dict(args))
    except Exception as e:  # noqa: BLE001 - the real build reports its own errors
        print(
            f"trainerd python-model: warning: model file {path}: model(args) does not build on the meta device "
            f"({type(e).__name__}: {e}); `trainerd ckpt export` will name its tensors model.NAME, not by its "
            f"state_dict() keys",
            file=sys.stderr,
        )
        return {"export_names": []}
    if not isinstance(net, torch.nn.Module):
        return {"export_names": []}
    ids = {id(t): n for n, t in _variables(net)}
    names = [[k, ids[id(t)]] for k, t in net.state_dict(keep_vars=True).items() if id(t) in ids]
    embedding = None
    if callable(getattr(net, "get_input_embeddings", None)):
        try:
            embedding = net.get_input_embeddings()
        except Exception:  # noqa: BLE001 - not every model implements it
            embedding = None
    if not isinstance(embedding, torch.nn.Embedding):
        embedding = next((m for m in net.modules() if isinstance(m, torch.nn.Embedding)), None)
    vocab = None if embedding is None else int(embedding.num_embeddings)
    return {"export_names": names, "vocab_size": vocab}


def _tensor(value):
    return isinstance(value, torch.Tensor)


def _describe(value):
    if _tensor(value):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__}"


def _input(batch):
    inputs = [k for k in batch if k not in (LABEL, ATTENTION_MASK)]
    if len(inputs) != 1:
        raise TypeError(
            f"the default loss and predict take the one input column besides {LABEL!r} and {ATTENTION_MASK!r}; "
            f"the batch has {', '.join(batch) or 'none'}: define loss(module, batch) and predict(module, batch)"
        )
    return batch[inputs[0]]


def _outputs(value):
    """A module's outputs as a tensor: itself, or a model output's `logits` (Hugging Face)."""
    if not _tensor(value) and _tensor(getattr(value, "logits", None)):
        return value.logits
    return value


class Runner:
    """One instance of the file's module on a device, with its loss, metrics and predict."""

    def __init__(self, path, given, device):
        module = load(path)
        self.path = path = os.path.abspath(path)
        self.args = _arguments(path, module, given)
        self.loss_fn = getattr(module, "loss", None)
        self.metrics_fn = getattr(module, "metrics", None)
        self.predict_fn = getattr(module, "predict", None)
        self.metrics_take_outputs = self.metrics_fn is not None and _positional(self.metrics_fn) >= 3
        self.names = _metrics_of(path, module)
        self.first = True
        device = torch.device(device)
        # Deterministic kernels wherever libtorch has them. On CUDA the daemon has set them (the
        # process's one libtorch) before loading the plugin, strictly unless
        # --allow-nondeterministic-ops, and that setting stands: strict is what makes flash and
        # memory-efficient attention run their deterministic backward passes. On the CPU, where
        # the daemon sets nothing, an operation without one warns rather than failing.
        if not torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        net, self.keras = _build(path, module, self.args, str(device), _columns(path, module, self.args))
        if self.keras is not None:
            self.names = self.keras.metric_names()
            self.module = net
            # Each variable under its path; a seed generator's state is not among them.
            self.tensors = [(v.path, v.value) for v in self.keras.variables]
            return
        if not isinstance(net, torch.nn.Module):
            raise ModelFileError(
                f"model file {path}: model(args) returned {_describe(net)}, expected a torch.nn.Module"
            )
        self.module = net.to(device)
        params = list(self.module.named_parameters())
        if not any(p.requires_grad for _, p in params):
            raise ModelFileError(
                f"model file {path}: the module model(args) returned has no parameter that requires a gradient: "
                f"nothing to train"
            )
        # Parameters (shared ones once) and persistent buffers, each under its state_dict name.
        self.tensors = _variables(self.module)

    def _mode(self, train):
        # From the module itself: the file's own code may have switched it.
        if self.module.training != train:
            self.module.train(train)

    def _call(self, what, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise _raised(self.path, what, e) from None

    def _default_loss(self, batch):
        logits = _outputs(self.module(_input(batch)))
        return logits, F.nll_loss(logits.log_softmax(-1, dtype=torch.float32), batch[LABEL])

    def step(self, batch, train):
        """(mean loss, float64 metric sums in `names` order) of a batch."""
        if self.keras is not None:
            loss, sums = self._call("the Keras model's step", self.keras.step, batch, train)
            self._check_loss(loss, train)
            return loss, sums
        self._mode(train)
        logits = outputs = None
        if self.loss_fn is not None:
            loss = self._call("loss(module, batch)", self.loss_fn, self.module, batch)
            if isinstance(loss, (tuple, list)) and len(loss) == 2:
                loss, outputs = loss
        else:
            logits, loss = self._call("the forward pass (the default loss)", self._default_loss, batch)
            outputs = logits
        self._check_loss(loss, train)
        with torch.no_grad():
            if self.metrics_take_outputs:
                if outputs is None:
                    raise ModelFileError(
                        f"model file {self.path}: metrics(module, batch, outputs) takes the outputs, but loss(module, "
                        f"batch) returned none: return (loss, outputs) from it"
                    )
                outputs = outputs.detach() if _tensor(outputs) else outputs
                values = self._call("metrics(module, batch, outputs)", self.metrics_fn, self.module, batch, outputs)
                sums = self._sums(values, loss.device)
            elif self.metrics_fn is not None:
                # It runs the module again: in evaluation mode, so that BatchNorm's statistics are
                # not updated twice and dropout draws nothing more.
                self._mode(False)
                values = self._call("metrics(module, batch)", self.metrics_fn, self.module, batch)
                self._mode(train)
                sums = self._sums(values, loss.device)
            elif logits is not None:
                correct = logits.argmax(-1).eq(batch[LABEL]).sum(dtype=torch.float64)
                sums = correct.reshape(1)
            else:
                sums = torch.zeros(0, dtype=torch.float64, device=loss.device)
        return loss, sums

    def _check_loss(self, loss, train):
        what = "loss(module, batch)" if self.loss_fn is not None else "the default loss"
        if not _tensor(loss):
            raise ModelFileError(
                f"model file {self.path}: {what} returned {_describe(loss)}, expected a 0-dim tensor: the batch's "
                f"mean loss"
            )
        if loss.dim() != 0:
            raise ModelFileError(
                f"model file {self.path}: {what} returned {_describe(loss)}, expected a 0-dim tensor: the batch's "
                f"mean loss (reduce it with .mean())"
            )
        if train and torch.is_grad_enabled() and not loss.requires_grad:
            raise ModelFileError(
                f"model file {self.path}: {what} returned a tensor that does not require a gradient: it must be "
                f"computed from the module's parameters (not under torch.no_grad(), not detached)"
            )
        if self.first and train:
            self.first = False
            if not math.isfinite(loss.item()):
                raise ModelFileError(f"model file {self.path}: {what} is {loss.item()} on the first batch")

    def _sums(self, values, device):
        if not isinstance(values, dict):
            raise ModelFileError(
                f"model file {self.path}: metrics returned {_describe(values)}, expected a dict of name to the sum "
                f"over the batch's examples"
            )
        if list(values) != self.names:
            raise ModelFileError(
                f"model file {self.path}: metrics returned the keys {list(values)}, expected {self.names}"
            )
        out = []
        for name, v in values.items():
            try:
                v = torch.as_tensor(v, dtype=torch.float64, device=device)
            except Exception as e:  # noqa: BLE001
                raise ModelFileError(
                    f"model file {self.path}: metrics[{name!r}] is {_describe(v)}, which is not a number: {e}"
                ) from None
            if v.numel() != 1:
                raise ModelFileError(
                    f"model file {self.path}: metrics[{name!r}] is {_describe(v)}, expected one number: the sum "
                    f"over the batch's examples"
                )
            out.append(v.reshape(()))
        if not out:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.stack(out)

    def predict(self, batch):
        """Outputs per example of a batch, in evaluation mode without gradients."""
        if self.keras is not None:
            out = self._call("the Keras model's predict", self.keras.predict, batch)
        else:
            out = self._predict(batch)
        out = _outputs(out)
        n = next(iter(batch.values())).shape[0] if batch else 0
        if not _tensor(out) or out.dim() == 0 or out.shape[0] != n:
            raise ModelFileError(
                f"model file {self.path}: predict returned {_describe(out)}, expected a tensor of {n} examples along "
                f"its first dimension"
            )
        return out

    def _predict(self, batch):
        self._mode(False)
        with torch.no_grad():
            if self.predict_fn is not None:
                out = self._call("predict(module, batch)", self.predict_fn, self.module, batch)
            else:
                out = self._call("the forward pass (the default predict)", lambda b: self.module(_input(b)), batch)
        return out
