"""trainerd's side of a compiled Keras 3 model (its PyTorch backend) that a model file's
model(args) returns, run inside the python-model plugin's interpreter beside `runtime.py`.

What `compile` said is read and checked here: the loss (with the regularizers' penalties, as
`fit` adds them), the metrics that are means over examples, and the optimizer, which trainerd runs
with Keras's rules (`OptimizerConfig::Keras`). The model is built as trainerd needs it: Keras's
layer names counted afresh and its seed taken from trainerd's before every build, its variables on
trainerd's device, a subclassed model built from a batch of the data's shapes. Each step calls it
as Keras's own torch trainer does (`training=True`, `compute_loss`), images channels-last, and
every seed generator (a seeded Dropout's) drawn afresh from trainerd's per-step, per-slot seed.

Every problem is raised as `Refused` with a message that `runtime.py` puts after "model file
PATH: ".
"""

import contextlib
import importlib
import sys

import numpy as np
import torch

LABEL = "label"
ATTENTION_MASK = "attention_mask"
OPTIMIZERS = "SGD, Adam, AdamW and RMSprop"
METRICS = (
    "those that are a mean over examples: accuracy (and binary_, categorical_, sparse_categorical_, "
    "top_k_ and sparse_top_k_categorical_accuracy), mean_squared_error, mean_absolute_error, "
    "mean_absolute_percentage_error, mean_squared_logarithmic_error, the crossentropies, hinge, kl_divergence, "
    "log_cosh_error, poisson, cosine_similarity"
)
# Those of Keras's loss reductions that are the batch's mean (what trainerd averages over workers).
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class Refused(Exception):
    """What trainerd cannot take of a Keras model, the message complete after "model file PATH: "."""


def imported(source=None):
    """Keras, when the process imported it (or the model file's source names it: it is imported
    then, with the torch backend, so that it can be prepared before the file's model(args))."""
    found = sys.modules.get("keras")
    if found is None and source is not None and b"keras" in source:
        found = importlib.import_module("keras")
    return found if found is not None and hasattr(found, "Model") else None


def is_model(net):
    k = imported()
    return k is not None and isinstance(net, k.Model)


@contextlib.contextmanager
def building(source, device, seed):
    """Around a build of the file's model: Keras's global state cleared (its layer-name counter,
    so that the variables' paths are the same in every build: `sequential/dense/kernel`, not
    `sequential_1/...`), its seeds set from `seed` (Keras reseeds torch too), its variables made on
    `device`. Nothing for a file that does not use Keras."""
    k = imported(source)
    if k is None:
        yield
        return
    check_backend(k)
    k.backend.clear_session(free_memory=False)
    k.utils.set_random_seed(int(seed) % 2**32)
    with k.device(device):
        yield


def backend_refusal(backend):
    """What is said of Keras on the backend `backend` (the file set KERAS_BACKEND itself)."""
    return (
        f"Keras's backend is {backend} here, not torch: trainerd trains Keras models on the torch backend, and the "
        f"plugin sets KERAS_BACKEND=torch before the file runs; do not set it in the file"
    )


def check_backend(k):
    """Refuses a Keras that does not run on its torch backend."""
    if k.backend.backend() != "torch":
        raise Refused(backend_refusal(k.backend.backend()))


def identity():
    """What of Keras makes the model the one it is."""
    k = imported()
    if k is None:
        return {}
    return {
        "keras": k.__version__,
        "keras backend": k.backend.backend(),
        "keras floatx": k.config.floatx(),
        "keras image_data_format": k.config.image_data_format(),
        "keras epsilon": repr(k.config.epsilon()),
    }


def _kind(spec):
    kind, _, size = str(spec).strip().partition(":")
    dims = [int(d) for d in size.split("x")] if size.strip() else []
    return kind.strip(), dims


def _dummy(columns):
    """A batch of one example of `columns`' shapes and kinds, zeros."""
    out = {}
    for name, spec in columns.items():
        kind, dims = _kind(spec)
        if kind == "image":
            out[name] = torch.zeros([1] + dims)
        elif kind in ("tokens", "text"):
            out[name] = torch.zeros([1] + dims, dtype=torch.int64)
        elif kind == "integer":
            out[name] = torch.zeros([1], dtype=torch.int64)
        else:
            out[name] = torch.zeros([1] + dims)
    return out


def _f32(x):
    """`x` as the shortest decimal of its float32 value (Keras holds a learning rate as float32)."""
    return float(str(np.float32(x)))


class KerasModel:
    """A compiled Keras model as trainerd trains it."""

    def __init__(self, net, columns, device):
        k = self.k = imported()
        check_backend(k)
        self.net, self.device = net, device
        self.channels_last = k.config.image_data_format() == "channels_last"
        if LABEL not in columns:
            raise Refused(
                f"a Keras model trains on a {LABEL!r} column (compile()'s loss compares the outputs with it); the "
                f"data's columns are {', '.join(columns)}"
            )
        self.inputs = [n for n in columns if n != LABEL]
        self.images = {n for n, spec in columns.items() if _kind(spec)[0] == "image"}
        compiled = getattr(net, "_compile_config", None)
        if compiled is None or getattr(net, "optimizer", None) is None:
            raise Refused(
                "model(args) returned a Keras model that is not compiled: call model.compile(loss=..., "
                "optimizer=..., metrics=[...]) before returning it"
            )
        self.compiled = dict(compiled.config)
        self._check_compile()
        dummy = _dummy(columns)
        with torch.no_grad(), k.device(device):
            dummy = {n: t.to(device) for n, t in dummy.items()}
            y_pred = net(self.x(dummy), training=False)
        self.metrics = self._metrics(dummy[LABEL], y_pred)
        generators = []
        for layer in net._flatten_layers(include_self=True, recursive=True):
            generators.extend(getattr(layer, "_seed_generators", []))
        self.seed_states = [g.state for g in generators]
        drawn = {id(s) for s in self.seed_states}
        self.variables = [v for v in net.variables if id(v) not in drawn]
        self._check_dtypes()
        if not any(v.trainable for v in self.variables):
            raise Refused("the Keras model has no trainable variable: nothing to train")
        self.optimizer = self._optimizer()

    def _check_dtypes(self):
        """Every layer computes in float32 and every float variable is float32: trainerd's optimizer,
        all-reduce and checkpoints hold float32, and its mixed precision is --precision."""
        for layer in self.net._flatten_layers(include_self=False, recursive=True):
            policy = getattr(layer, "dtype_policy", None)
            compute = getattr(policy, "compute_dtype", "float32")
            if compute != getattr(policy, "variable_dtype", compute):
                raise Refused(
                    f"layer {layer.name!r} ({type(layer).__name__}) computes in {compute} (dtype policy "
                    f"{policy.name!r}); trainerd trains float32 layers: for mixed precision, give --precision bf16 "
                    f"(fp16 on CUDA) and leave the policy at float32"
                )
        for v in self.variables:
            dtype = str(v.dtype)
            if "float" in dtype and dtype != "float32":
                raise Refused(
                    f"the Keras variable {v.path} is {dtype}; trainerd trains float32 variables (keep the layers' "
                    f"dtype and keras.config.floatx() at float32)"
                )

    # ---- what compile() said ----

    def _check_compile(self):
        c = self.compiled
        loss = c.get("loss")
        if loss is None:
            raise Refused("the Keras model was compiled without a loss: compile(loss=...) names the loss trainerd "
                          "minimises")
        if isinstance(loss, (dict, list, tuple)):
            raise Refused(
                f"compile(loss=...) is a {type(loss).__name__} of losses (one per output); trainerd trains a Keras "
                f"model of one output with one loss"
            )
        if isinstance(loss, str):
            loss = self.k.losses.get(loss)
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in MEAN_REDUCTIONS:
            raise Refused(
                f"compile(loss=...) {type(loss).__name__} has reduction={reduction!r}, which is not the batch's mean; "
                f"trainerd averages the workers' mean losses: use reduction='sum_over_batch_size' (Keras's default)"
            )
        for arg in ("loss_weights", "weighted_metrics"):
            if c.get(arg):
                raise Refused(f"compile({arg}=...) is not taken: trainerd weighs every example alike")
        if c.get("jit_compile") is True:
            raise Refused("compile(jit_compile=True) is not taken: trainerd runs the model eagerly (torch.compile "
                          "is not used); leave jit_compile at its default")

    def _metrics(self, y_true, y_pred):
        """[(name, function, its keyword arguments)] of compile(metrics=[...])."""
        from keras.src.trainers.compile_utils import get_metric

        given = self.compiled.get("metrics")
        if given is None:
            return []
        if isinstance(given, dict):
            raise Refused("compile(metrics=...) is a dict (per output); trainerd takes a list, for one output")
        if not isinstance(given, (list, tuple)):
            given = [given]
        out = []
        for identifier in given:
            try:
                metric = get_metric(identifier, y_true, y_pred)
            except Exception as e:  # noqa: BLE001
                raise Refused(f"compile(metrics=[{identifier!r}]): {type(e).__name__}: {e}") from None
            if not isinstance(metric, self.k.metrics.MeanMetricWrapper):
                raise Refused(
                    f"compile(metrics=[...]) {type(metric).__name__} ({metric.name!r}) is not a mean over examples, "
                    f"which is what trainerd adds up over the workers; it takes {METRICS}"
                )
            out.append((metric.name, metric._fn, dict(metric._fn_kwargs)))
        return out

    def metric_names(self):
        return [name for name, _, _ in self.metrics]

    def _optimizer(self):
        """compile()'s optimizer as trainerd's `OptimizerConfig::Keras` (JSON)."""
        k, opt = self.k, self.net.optimizer
        kinds = [(k.optimizers.AdamW, "adamw"), (k.optimizers.Adam, "adam"), (k.optimizers.SGD, "sgd"),
                 (k.optimizers.RMSprop, "rmsprop")]
        name = next((n for cls, n in kinds if isinstance(opt, cls)), None)
        if name is None:
            raise Refused(
                f"compile(optimizer=...) {type(opt).__name__} is not taken; trainerd runs {OPTIMIZERS} with Keras's "
                f"rules"
            )
        lr = opt._learning_rate
        if isinstance(lr, k.optimizers.schedules.LearningRateSchedule) or callable(lr):
            raise Refused(
                f"compile(optimizer=...) {type(opt).__name__}'s learning_rate is a schedule "
                f"({type(lr).__name__}); trainerd's schedules are flags: give a number and --lr-schedule "
                f"(constant, step, exponential, cosine, linear, wsd) with --warmup-steps"
            )
        c = opt.get_config()
        refusals = [
            ("use_ema", c.get("use_ema"), "the moving average of the weights is not kept"),
            ("loss_scale_factor", c.get("loss_scale_factor"), "use --precision for mixed precision"),
            ("gradient_accumulation_steps", c.get("gradient_accumulation_steps"),
             "use --accumulate N (micro-batches per update)"),
            ("amsgrad", c.get("amsgrad"), "trainerd's Adam has no AMSGrad"),
        ]
        for arg, value, why in refusals:
            if value:
                raise Refused(f"compile(optimizer=...) {type(opt).__name__}({arg}={value!r}) is not taken: {why}")
        if name == "sgd":
            rule = {"kind": "sgd", "momentum": float(c["momentum"]), "nesterov": bool(c["nesterov"])}
        elif name in ("adam", "adamw"):
            rule = {"kind": name, "beta1": float(c["beta_1"]), "beta2": float(c["beta_2"]),
                    "eps": float(c["epsilon"])}
        else:
            rule = {"kind": "rmsprop", "rho": float(c["rho"]), "momentum": float(c["momentum"]),
                    "eps": float(c["epsilon"]), "centered": bool(c["centered"])}
        decay = float(c.get("weight_decay") or 0.0)
        exempt = [v.path for v in self.variables if v.trainable and decay and not opt._use_weight_decay(v)]
        clip = {arg: (None if c.get(arg) is None else float(c[arg]))
                for arg in ("clipnorm", "global_clipnorm", "clipvalue")}
        return {"name": "keras", "rule": rule, "lr": _f32(float(lr.numpy() if hasattr(lr, "numpy") else lr)),
                "weight_decay": decay, "no_decay": exempt, **clip}

    # ---- a step ----

    def x(self, batch):
        """The model's input from a batch: its one input column (several: a dict by name), images
        channels-last when Keras's image_data_format is."""
        xs = {}
        for name in self.inputs:
            t = batch[name]
            if name in self.images and self.channels_last:
                # Laid out channels-last in memory too, with the strides of a contiguous NHWC array
                # (as fit's arrays come): Keras's layers then run libtorch's channels-last kernels
                # (a permuted view of NCHW memory takes slower ones: 26 against 21 ms a step of the
                # tutorial's CNN, batch 64).
                t = t.permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format)
            xs[name] = t
        return xs[self.inputs[0]] if len(xs) == 1 else xs

    def _reseed(self):
        """Every seed generator's state drawn from torch's generator, which trainerd seeds for each
        step and slot: a seeded Dropout masks each slot's examples differently, and the same in a
        rerun. The states are not the model's: trainerd neither averages nor checkpoints them."""
        for state in self.seed_states:
            value = state.value
            state.assign(torch.randint(1, 2**30, tuple(value.shape), dtype=value.dtype, device=value.device))

    def step(self, batch, train):
        """(the batch's loss as fit computes it, float64 metric sums)."""
        x, y = self.x(batch), batch[LABEL]
        with self.k.device(self.device):
            if train:
                self._reseed()
            y_pred = self.net(x, training=train)
            loss = self.net.compute_loss(x=x, y=y, y_pred=y_pred, training=train)
        with torch.no_grad():
            y_pred = y_pred.detach()
            n = y_pred.shape[0]
            sums = [fn(y, y_pred, **kw).reshape(n, -1).to(torch.float64).mean(-1).sum() for _, fn, kw in self.metrics]
            sums = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=y_pred.device)
        return loss, sums

    def predict(self, batch):
        with torch.no_grad(), self.k.device(self.device):
            return self.net(self.x(batch), training=False)
