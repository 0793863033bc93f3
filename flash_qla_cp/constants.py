"""Constants every form of the algorithm shares (torch references, host code and kernels)."""

CHUNK = 64  # tokens per chunk of the chunked (WY / UT) form

# The intra-card split's warm-up shortcut: a state damped by exp(-16) ~ 1.1e-7 (the fp32
# resolution) may be dropped. The bound
# ||prod_t exp(g_t) (I - beta_t k_t k_t^T)|| <= exp(sum g) needs beta_t ||k_t||^2 <= 2, i.e. no
# step that expands the state: the layer's l2-normalised k and sigmoid beta give that, and
# inputs without it make the recurrence itself grow without bound. g <= 0 by definition.
WARMUP_LOG_DECAY = -16.0

# The Hopper kernels floor each gate here as they read it (the prepare kernel; every other kernel
# reads its chunk-local sums G): g = -inf (a reset) then gives a state factor of exp(-64) ~ 1.6e-28,
# 0 to fp32 rounding, instead of NaN from -inf - (-inf); and a gate of -1e30 no longer absorbs the
# gates after it in the fp32 sum (64 floored gates sum to -4096, where fp32 still resolves 5e-4).
# Its gradient is 0 (the floored function is flat there). NaN gates stay NaN. The torch backend
# sums in float64 and floors at reference.chunked.GATE_FLOOR.
KERNEL_GATE_FLOOR = -64.0
