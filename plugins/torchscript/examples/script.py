"""Scripts one of models.py's models with its initial weights and saves it for trainerd.

    python script.py MODEL OUT.pt [--seed N]

then train it on two workers, for example:

    trainerd local --workers 2 --plugin target/release/libtorchscript.so \
        --plugin-arg module=OUT.pt [--plugin-arg input_shape=28x28] --data DATA_DIR

TorchScript is deprecated since PyTorch 2.5 (torch.export is its successor for inference, with no
training runtime a C++ host can drive), but torch.jit.script still writes these files.
"""
import argparse

import torch

import models

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(models.MODELS))
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scripted = torch.jit.script(models.build(args.model, args.seed))
    scripted.save(args.out)
    print(f"wrote {args.out}: {args.model}, plugin arguments: module={args.out}",
          *models.PLUGIN_ARGS[args.model])
