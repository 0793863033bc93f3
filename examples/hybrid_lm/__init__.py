"""A small hybrid language model (Gated DeltaNet blocks with an optional softmax-attention block
every few layers), its trainer, a byte-level data loader and the corpus it trains on: the
README's main job (`launch/train_tiny.sh`), and the long-sequence recipe (`launch/train_long.sh`)."""
