#!/usr/bin/env python3
"""Two-worker training throughput of a CNN on Fashion-MNIST, in one session:
trainerd (`trainerd local --workers 2`), PyTorch DDP over gloo (../shared/bench/torch_cnn.py) and
TensorFlow MultiWorkerMirroredStrategy with RING (../shared/bench/tf_mwms_cnn.py). Same model,
Adam 1e-3, per-worker batch 64 (global 128), one thread per worker process, alternating runs;
prints medians and ratios. TensorFlow runs from its own virtualenv (TF_VENV).

Usage: bench/multi_worker.sh [--model cnn|big] [--runs N] [--steps N]
--model cnn (default) is the tutorials' CNN (mnist-cnn, 0.35 M parameters); --model big is seed 000's
CNN (mnist-cnn-big; the peers' CNN=big; 2.77 M parameters), where communication dominates.
trainerd's figure covers every step of its run, warm-up included; the peers exclude 20 warm-up
steps, so the comparison leans slightly toward them.
"""
import argparse, json, os, re, socket, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")
TF_VENV = os.environ.get("TF_VENV", os.path.expanduser("~/.cache/trainerd/venv-tf"))

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def rate(out):
    return float(re.search(r"examples_per_s=(\d+)", out).group(1))

PLUGINS = {"cnn": "libmnist_cnn.so", "big": "libmnist_cnn_big.so"}

def trainerd(steps, model):
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        subprocess.run([os.path.join(ROOT, "target/release/trainerd"), "local", "--workers", "2",
                        "--plugin", os.path.join(ROOT, "target/release", PLUGINS[model]), "--data", DATA,
                        "--epochs", "1", "--batch-size", "64", "--threads", "1", "--steps-per-epoch", str(steps),
                        "--summary", summary], check=True, capture_output=True, text=True)
        return json.load(open(os.path.join(d, "s.worker0.json")))["examples_per_second"]

def peer_env(model):
    env = {**os.environ, "DATA": DATA}
    env.pop("CNN", None)
    if model == "big":
        env["CNN"] = "big"
    return env

def ddp(steps, model):
    out = subprocess.run([sys.executable, os.path.join(SHARED, "bench", "torch_cnn.py"), "ddp", "2", "1", str(steps),
                          str(free_port())], check=True, capture_output=True, text=True, env=peer_env(model)).stdout
    return rate(out)

def mwms(steps, model):
    ports = f"{free_port()},{free_port()}"
    env = {**peer_env(model), "TFPORTS": ports, "TF_USE_LEGACY_KERAS": "1", "OMP_NUM_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    py = os.path.join(TF_VENV, "bin", "python")
    script = os.path.join(SHARED, "bench", "tf_mwms_cnn.py")
    procs = [subprocess.Popen([py, script, "mw", str(i), str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    outs = [p.communicate() for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"tf_mwms_cnn.py failed:\n{e[-2000:]}")
    return rate(outs[0][0])

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=sorted(PLUGINS), default="cnn")
    a = ap.parse_args()
    results = {"trainerd": [], "pytorch-ddp": [], "tf-mwms": []}
    for r in range(a.runs):
        results["pytorch-ddp"].append(ddp(a.steps, a.model))
        results["tf-mwms"].append(mwms(a.steps, a.model))
        results["trainerd"].append(trainerd(a.steps + 20, a.model))
        print(f"run {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()) + " examples/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    name = {"cnn": "mnist-cnn (0.35 M parameters)", "big": "mnist-cnn-big (2.77 M parameters)"}[a.model]
    print(f"2-worker {name}, global batch 128, 1 thread per worker, median of {a.runs}: "
          f"trainerd {med['trainerd']:,.0f} examples/s, PyTorch DDP {med['pytorch-ddp']:,.0f} "
          f"({med['trainerd'] / med['pytorch-ddp']:.2f}x), TF MWMS {med['tf-mwms']:,.0f} "
          f"({med['trainerd'] / med['tf-mwms']:.2f}x)")

if __name__ == "__main__":
    main()
