"""The TileLang backend: host code (`forward`, `backward`, `split`, `runtime`, `tables`) over the
Hopper kernels of `hopper/`, one kernel per file. Importing it needs neither TileLang nor a GPU."""
