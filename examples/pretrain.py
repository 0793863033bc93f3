"""Pretrain the small hybrid Gated DeltaNet LM on the shipped corpus (1 process or torchrun).

    python examples/pretrain.py --steps 50 --seq-len 1024
    torchrun --standalone --nproc-per-node 2 examples/pretrain.py --cp 2 --steps 50 --seq-len 1024

All flags: python examples/pretrain.py --help (examples/hybrid_lm/trainer.py).
"""

import sys

from hybrid_lm.trainer import main

if __name__ == "__main__":
    main(sys.argv[1:])
